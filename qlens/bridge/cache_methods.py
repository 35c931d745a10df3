"""TransformerLens' ``ActivationCache`` analysis methods, computed by ``qlens.analysis``.

Signatures, defaults and results follow TransformerLens 4.3: ``layer=None`` or ``-1`` is the
final residual, ``pos_slice`` / ``neuron_slice`` / ``batch_slice`` take its ``Slice`` inputs,
and norms applied to a stack leave the norm's weight out. ``norm_weight=True`` multiplies by it
as the model does, so that on a model whose norms are not folded the attributions add up to the
model's own logits (see docs/coming_from_transformerlens.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from qlens import analysis
from qlens.analysis.components import head_results, neuron_results
from qlens.analysis.slicing import Slice, SliceInput

Stack = Float[Tensor, "component ..."]
StackOrLabeled = Stack | tuple[Stack, list[str]]

logger = logging.getLogger(__name__)


class CacheAnalysisMethods:
    """Residual-stream stacks, norms and logit attribution on a cache of one bridge forward."""

    cache: dict[str, Tensor]
    n_layers: int
    bridge: Any
    has_batch_dim: bool

    if TYPE_CHECKING:  # provided by ActivationCache

        def __getitem__(self, key: Any) -> Tensor: ...
        def __contains__(self, key: object) -> bool: ...
        def _stack(self, tensors: list[Tensor], what: str) -> Tensor: ...

    # -- helpers ----------------------------------------------------------------------------
    def _model(self, what: str) -> Any:
        if self.bridge is None:
            raise ValueError(
                f"{what} reads the model's weights or norms, but this cache was built without "
                "its bridge; get the cache from bridge.run_with_cache(...) or pass "
                "ActivationCache(..., bridge=bridge)"
            )
        return self.bridge

    def _final_layer(self, layer: int | None) -> int:
        if layer is None or layer == -1:
            return self.n_layers
        if not 0 <= layer <= self.n_layers:
            raise ValueError(
                f"layer must be in [0, {self.n_layers}], or None or -1 for the final residual; "
                f"got {layer}"
            )
        return layer

    def _empty_stack(self, pos_slice: Slice) -> Tensor:
        like = pos_slice.apply(self["hook_embed"], -2)
        return like.new_zeros((0, *like.shape))

    def _finish(self, stack: Tensor, labels: list[str], return_labels: bool) -> StackOrLabeled:
        return (stack, labels) if return_labels else stack

    # -- residual stream ----------------------------------------------------------------------
    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: SliceInput = None,
        mlp_input: bool = False,
        return_labels: bool = False,
        *,
        norm_weight: bool = False,
    ) -> StackOrLabeled:
        """The residual stream before each layer up to ``layer`` (None / -1: every layer and the
        final residual), with each ``resid_mid`` when ``incl_mid``, and ``layer``'s own
        ``resid_mid`` when ``mlp_input``.

        ``apply_ln`` applies the final norm afresh to each entry when ``layer`` is the final
        residual (a logit lens), else ``layer``'s norm with its cached scale (as
        :meth:`apply_ln_to_stack`).
        """
        layer = self._final_layer(layer)
        pos = Slice(pos_slice)
        parts, labels = [], []
        for i in range(layer + 1):
            if i == self.n_layers:
                parts.append(self["resid_post", self.n_layers - 1])
                labels.append("final_post")
                continue
            parts.append(self["resid_pre", i])
            labels.append(f"{i}_pre")
            if (incl_mid and i < layer) or (mlp_input and i == layer):
                parts.append(self["resid_mid", i])
                labels.append(f"{i}_mid")
        stack = self._stack([pos.apply(p, -2) for p in parts], "the residual stream")
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack,
                layer,
                mlp_input,
                pos_slice=pos,
                recompute_ln=layer == self.n_layers,
                norm_weight=norm_weight,
            )
        return self._finish(stack, labels, return_labels)

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: SliceInput = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
        *,
        norm_weight: bool = False,
    ) -> StackOrLabeled:
        """The input of ``layer`` (its MLP with ``mlp_input``) as the embeddings and each earlier
        attention and MLP output (``mode``: ``"all"``, ``"attn"`` or ``"mlp"``)."""
        layer = self._final_layer(layer)
        bridge = self._model("decompose_resid")
        parts = analysis.decompose_resid(
            bridge, self, layer, mode=mode, incl_embeds=incl_embeds, mlp_input=mlp_input
        )
        pos = Slice(pos_slice)
        stack = pos.apply(parts.values, -2)
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, layer, mlp_input, pos_slice=pos, norm_weight=norm_weight
            )
        return self._finish(stack, parts.labels["component"], return_labels)

    def get_full_resid_decomposition(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: SliceInput = None,
        return_labels: bool = False,
        project_output_onto: Tensor | None = None,
        *,
        norm_weight: bool = False,
    ) -> StackOrLabeled:
        """Every head, every neuron (or MLP with ``expand_neurons=False``), the embeddings and
        the summed biases, adding up to the input of ``layer``. ``project_output_onto``
        (``[d_model]`` or ``[d_model, n]``) projects each component's last dimension."""
        layer = self._final_layer(layer)
        bridge = self._model("get_full_resid_decomposition")
        parts = analysis.get_full_resid_decomposition(
            bridge, self, layer, expand_neurons=expand_neurons, mlp_input=mlp_input
        )
        pos = Slice(pos_slice)
        stack = pos.apply(parts.values, -2)
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, layer, mlp_input, pos_slice=pos, norm_weight=norm_weight
            )
        return self._finish(
            _project(stack, project_output_onto), parts.labels["component"], return_labels
        )

    # -- heads and neurons ----------------------------------------------------------------------
    def compute_head_results(self) -> None:
        """Store each layer's per-head outputs as ``blocks.{i}.attn.hook_result``
        ``[*batch pos head d_model]`` (from ``hook_z`` and W_O) where they are not cached."""
        bridge = self._model("compute_head_results")
        missing = [i for i in range(self.n_layers) if f"blocks.{i}.attn.hook_result" not in self]
        if not missing:
            logger.warning("compute_head_results: every layer's hook_result is already cached")
        for i in missing:
            self.cache[f"blocks.{i}.attn.hook_result"] = head_results(bridge, self, i)

    def stack_head_results(
        self,
        layer: int | None = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: SliceInput = None,
        apply_ln: bool = False,
        *,
        norm_weight: bool = False,
    ) -> StackOrLabeled:
        """Each head's output (``L{i}H{h}``) for the layers before ``layer``, bias excluded;
        ``incl_remainder`` adds the rest of the residual stream as a last component."""
        layer = self._final_layer(layer)
        bridge = self._model("stack_head_results")
        pos = Slice(pos_slice)
        if layer:
            heads = analysis.stack_head_results(bridge, self, layer)
            stack, labels = pos.apply(heads.values, -2), list(heads.labels["component"])
        else:
            stack, labels = self._empty_stack(pos), []
        if incl_remainder:
            # layer 0 reads resid_post of layer -1, the final residual, as TransformerLens does
            remainder = pos.apply(self["resid_post", layer - 1], -2) - stack.sum(0)
            stack, labels = torch.cat([stack, remainder[None]]), [*labels, "remainder"]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos, norm_weight=norm_weight)
        return self._finish(stack, labels, return_labels)

    def get_neuron_results(
        self,
        layer: int,
        neuron_slice: SliceInput = None,
        pos_slice: SliceInput = None,
        project_output_onto: Tensor | None = None,
    ) -> Tensor:
        """Each neuron's output ``post_n * W_out[n]`` at ``layer`` ``[*batch pos neuron d_model]``
        (an int ``neuron_slice`` drops the neuron axis); ``project_output_onto`` projects the
        last dimension (a 1-D direction drops it)."""
        bridge = self._model("get_neuron_results")
        layer = layer + self.n_layers if layer < 0 else layer
        result = Slice(pos_slice).apply(neuron_results(bridge, self, layer, neuron_slice), -3)
        if Slice(neuron_slice).mode == "int":
            result = result.squeeze(-2)
        return _project(result, project_output_onto)

    def stack_neuron_results(
        self,
        layer: int | None,
        pos_slice: SliceInput = None,
        neuron_slice: SliceInput = None,
        return_labels: bool = False,
        incl_remainder: bool = False,
        apply_ln: bool = False,
        project_output_onto: Tensor | None = None,
        mlp_input: bool = False,
        *,
        norm_weight: bool = False,
    ) -> StackOrLabeled:
        """Each neuron's output (``L{i}N{n}``) for the layers before ``layer``, bias excluded;
        ``incl_remainder`` adds the rest of the input of ``layer`` (its MLP with ``mlp_input``)."""
        layer = self._final_layer(layer)
        bridge = self._model("stack_neuron_results")
        pos = Slice(pos_slice)
        neurons = Slice(neuron_slice)
        indices = neurons.apply(torch.arange(bridge.cfg.d_mlp), 0).reshape(-1).tolist()
        parts = [
            pos.apply(neuron_results(bridge, self, i, neuron_slice), -3).movedim(-2, 0)
            for i in range(layer)
        ]
        stack = torch.cat(parts) if parts else self._empty_stack(pos)
        labels = [f"L{i}N{n}" for i in range(layer) for n in indices]
        if incl_remainder:
            target = ("resid_mid", layer) if mlp_input else ("resid_post", layer - 1)
            remainder = pos.apply(self[target], -2) - stack.sum(0)
            stack, labels = torch.cat([stack, remainder[None]]), [*labels, "remainder"]
        if apply_ln:
            stack = self.apply_ln_to_stack(
                stack, layer, mlp_input, pos_slice=pos, norm_weight=norm_weight
            )
        return self._finish(_project(stack, project_output_onto), labels, return_labels)

    # -- norms and logits -------------------------------------------------------------------------
    def apply_ln_to_stack(
        self,
        residual_stack: Stack,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: SliceInput = None,
        batch_slice: SliceInput = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
        *,
        norm_weight: bool = False,
    ) -> Stack:
        """Each component as the norm in front of ``layer`` sees it, with the full residual's
        cached scale (centered first for LayerNorm); ``recompute_ln`` at the final layer applies
        the final norm to each component afresh instead. ``pos_slice`` / ``batch_slice`` say
        which part of the cached scale the stack covers (``batch_slice`` also slices the stack
        when ``has_batch_dim``). ``norm_weight=True`` multiplies by the norm's weight."""
        bridge = self._model("apply_ln_to_stack")
        layer = self._final_layer(layer)
        batch = Slice(batch_slice)
        if has_batch_dim:
            residual_stack = batch.apply(residual_stack, 1)
        if recompute_ln and layer == self.n_layers:
            return bridge.ln_final(residual_stack)
        return analysis.apply_ln_to_stack(
            bridge,
            self,
            residual_stack,
            layer,
            mlp_input=mlp_input,
            norm_weight=norm_weight,
            pos_slice=pos_slice,
            batch_slice=batch if self.has_batch_dim else None,
        )

    def logit_attrs(
        self,
        residual_stack: Stack,
        tokens: str | int | Tensor,
        incorrect_tokens: str | int | Tensor | None = None,
        pos_slice: SliceInput = None,
        batch_slice: SliceInput = None,
        has_batch_dim: bool = True,
        *,
        norm_weight: bool = False,
        allow_softcap: bool = False,
    ) -> Float[Tensor, "component ..."]:
        """Direct logit attribution: each component, through the final norm's cached scale
        (:meth:`apply_ln_to_stack`), dotted with the unembedding of ``tokens`` (minus that of
        ``incorrect_tokens``). Tokens may be strings of one token each.

        With ``norm_weight=False`` (TransformerLens' result) the attributions add up to the
        logit (difference) only on a model whose final norm is folded
        (``qlens.weights.process_weights``); ``norm_weight=True`` makes them add up on any model.
        """
        bridge = self._model("logit_attrs")
        correct = _token_ids(bridge, tokens)
        wrong = None if incorrect_tokens is None else _token_ids(bridge, incorrect_tokens)
        scaled = self.apply_ln_to_stack(
            residual_stack,
            -1,
            pos_slice=pos_slice,
            batch_slice=batch_slice,
            has_batch_dim=has_batch_dim,
            norm_weight=norm_weight,
        )
        return analysis.logit_attrs(bridge, scaled, correct, wrong, allow_softcap=allow_softcap)


def _project(stack: Tensor, direction: Tensor | None) -> Tensor:
    if direction is None:
        return stack
    if direction.ndim not in (1, 2):
        raise ValueError(
            f"project_output_onto must be [d_model] or [d_model, n], got {tuple(direction.shape)}"
        )
    return stack @ direction.to(device=stack.device, dtype=stack.dtype)


def _token_ids(bridge: Any, tokens: str | int | Tensor) -> int | Tensor:
    if isinstance(tokens, str):
        return int(bridge.to_single_token(tokens))
    return tokens
