"""Bridge: TransformerLens-style hook points on an unmodified HF causal LM.

The bridge never rewrites, copies or moves the model. Its PyTorch hooks exist only during a
bridge call (``forward``/``__call__``, ``run_with_hooks``, ``run_with_cache``, ``generate``)
that has hooks active, and attention internals switch the model to the ``"qlens"`` attention
implementation only for that call; everything is restored even when the forward raises.

Hook-name conventions (see ``qlens.bridge.names``):

* ``blocks.{i}.hook_attn_out`` / ``hook_mlp_out`` are the outputs of the attention / MLP
  modules. In sandwich-norm families (Gemma 2/3) the residual receives the post-norms'
  outputs, hooked as ``blocks.{i}.ln1_post.hook_out`` / ``ln2_post.hook_out``.
* ``hook_resid_mid`` exists only for sequential attention/MLP (not GPT-NeoX's parallel
  blocks); editing it replaces the attention branch by ``new - resid_pre``.
* In MoE layers with a shared expert (Qwen2-MoE), ``mlp.hook_routed_out`` (the routed
  experts' weighted sum) and ``mlp.hook_shared_expert_out`` (the shared expert times its
  sigmoid gate) are the two terms of ``hook_mlp_out``; an edit to either changes the sum.
* ``hook_resid_post`` of the last layer is before the final norm.
* ``hook_embed`` is the token-embedding module's output (Gemma: already scaled by
  sqrt(d_model)); ``hook_pos_embed`` exists only for learned positions (GPT-2, OPT).
* ``ln*.hook_scale`` is sqrt(var + eps) (LayerNorm) or sqrt(mean(x^2) + eps) (RMSNorm)
  ``[batch pos 1]``; ``ln*.hook_normalized`` is the (centered) input divided by it, before the
  weight; ``ln*.hook_out`` is the norm module's output (as TransformerLens).
* ``attn.hook_q``/``hook_k``/``hook_v`` are the projections' outputs; on rotary models q/k are
  before rotary (and before q/k norms) and ``hook_rot_q``/``hook_rot_k`` hold them rotated.
* ``attn.hook_pattern`` excludes the probability mass of attention sinks (GPT-OSS): rows sum
  to ``1 - p_sink`` and ``hook_z = pattern @ v``. Masked scores hold the dtype's minimum.
* With a KV cache (``generate``), ``attn.hook_v`` and the key hook attention reads
  (``hook_rot_k`` on rotary models, ``hook_k`` otherwise) show every cached position too; edits
  to them affect the current step only.
* ``attn.hook_result`` is opt-in (``names_filter=None`` skips it): it reads the output
  projection's weight, which must be readable (not quantized).
* Hooks fire during bridge calls only; calling the HF model directly runs it unhooked.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge import attention, taps
from qlens.bridge.adapters import Adapter, get_adapter
from qlens.bridge.cache import ActivationCache
from qlens.bridge.config import BridgeConfig, build_config
from qlens.bridge.generation import hf_generate_kwargs
from qlens.bridge.layer_range import (
    Skipping,
    Start,
    StopForward,
    check_fireable,
    fires_before,
    fires_from,
    layer_position,
    start_hook,
    stop_hook,
)
from qlens.bridge.layout import build_layer_sites, require_module, resolve_layers
from qlens.bridge.loss import lm_loss
from qlens.bridge.model_api import ModelAPI
from qlens.bridge.names import (
    NamesFilter,
    layer_of,
    model_hook_names,
    resolve_names,
    unknown_name_error,
)
from qlens.bridge.switches import SWITCHED_SUFFIXES, HookSwitches
from qlens.bridge.token_api import Input
from qlens.bridge.tokens import (
    PaddingSide,
    default_padding_side,
    has_bos_candidate,
    positions_from_mask,
)
from qlens.hooks import HookFn, HookHandle, HookPoint

HookSpec = tuple[str | Callable[[str], bool], HookFn]


class Bridge(HookSwitches, ModelAPI):
    """Hook points, caching and generation for a supported HF causal LM."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        reroute: bool = True,
        keep_forward: Sequence[str] | None = None,
    ) -> None:
        """Wrap ``model`` (never moved or copied).

        HF-quantized modules that cannot run here (FP8Linear/FP8Experts without hub kernels,
        HiggsLinear without a tuned workspace, GPT-OSS MXFP4 experts without the kernels
        package) run through qlens' kernels instead, and each rerouted module is logged and
        listed in ``self.rerouted``; ``reroute=False`` keeps every module's own forward, and
        ``keep_forward`` keeps it for the modules whose names match those glob patterns.
        """
        from qlens.modules.reroute import reroute_quantized_modules
        from qlens.modules.siblings import group_siblings

        self.model = model
        self.tokenizer = tokenizer
        self.rerouted: list[str] = (
            reroute_quantized_modules(model, keep=keep_forward) if reroute else []
        )
        group_siblings(model)  # q/k/v and gate/up share one launch at one row
        self.adapter: Adapter = get_adapter(model)
        self._layers = resolve_layers(model, self.adapter)
        attention.register()
        guard_compiled_graphs_on_hooks()
        a, rms = self.adapter, self.adapter.normalization_type == "RMS"
        self.embed = require_module(model, a.embed, "token embedding")
        self.pos_embed = (
            require_module(model, a.pos_embed, "position embedding") if a.pos_embed else None
        )
        self.ln_final = require_module(model, a.ln_final, "final norm")
        self.unembed = require_module(model, a.unembed, "unembedding")
        eps = taps.norm_eps(self.ln_final)
        self.cfg: BridgeConfig = build_config(model.config, a, len(self._layers), eps)
        if tokenizer is not None:
            side = default_padding_side(tokenizer)
            # a tokenizer with neither BOS nor EOS has nothing to prepend by default
            bos = self.cfg.default_prepend_bos and has_bos_candidate(tokenizer)
            self.cfg = dataclasses.replace(
                self.cfg, default_padding_side=side, default_prepend_bos=bos
            )
        self._store: dict[str, Tensor] = {}
        self._sites: list[taps.Site] = [taps.OutputSite(self.embed, "hook_embed")]
        if self.pos_embed is not None:
            self._sites.append(taps.PositionEmbeddingSite(model, self.pos_embed, "hook_pos_embed"))
        for rl in self._layers:
            self._sites += build_layer_sites(rl, a, self.cfg, self._store, model)
        self._sites.append(taps.NormSite(self.ln_final, "ln_final", rms, a.norm_weight_offset))
        self.hook_names: list[str] = model_hook_names(
            [rl.layout for rl in self._layers], self.pos_embed is not None
        )
        self.hook_dict: dict[str, HookPoint] = {n: HookPoint(n) for n in self.hook_names}
        slot_names = [
            attention.slot_hook_names(f"blocks.{rl.index}.attn.", rl.layout.rotary)
            for rl in self._layers
        ]
        self._taps = [
            attention.AttentionTap(
                fast_fn=None,  # set on activation, from the implementation in use then
                points={slot: self.hook_dict[name] for slot, name in names.items()},
            )
            for names in slot_names
        ]
        # names fired inside qlens attention: activating one switches the implementation
        self._attention_fn_names = {name for names in slot_names for name in names.values()}
        self._running = False
        self._switch_state = dict.fromkeys(SWITCHED_SUFFIXES, False)
        self._setup_model_api()

    def _repr_html_(self) -> str:
        from qlens.rich_repr import render_html

        return render_html("bridge", self)

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"Bridge({type(self.model).__name__}, family={c.family}, n_layers={c.n_layers}, "
            f"d_model={c.d_model}, n_heads={c.n_heads}, {len(self.hook_names)} hook names)"
        )

    # -- hook management ---------------------------------------------------------------------
    def _names_for(self, name_or_filter: str | Callable[[str], bool]) -> list[str]:
        if isinstance(name_or_filter, str):
            if name_or_filter not in self.hook_dict:
                raise unknown_name_error(name_or_filter, self.hook_names)
            return [name_or_filter]
        if callable(name_or_filter):  # switched-off names are left out, as they cannot fire
            names = [n for n in self.hook_names if name_or_filter(n) and not self._switched_off(n)]
            if not names:
                raise ValueError("hook filter matched no hook name; see bridge.hook_names")
            return names
        raise TypeError(f"hook target must be a name or a filter callable, got {name_or_filter!r}")

    def add_hook(
        self,
        name_or_filter: str | Callable[[str], bool],
        fn: HookFn,
        dir: str = "fwd",
        is_permanent: bool = False,
        prepend: bool = False,
    ) -> list[HookHandle]:
        """Attach ``fn(tensor, hook)`` to every matching hook point until removed or reset
        (``is_permanent``: until a reset ``including_permanent``; ``prepend``: before the
        point's other hooks). Backward hooks (``dir="bwd"``) see the gradient of the
        activation; names whose gradient no hook can see are refused (a filter leaves them
        out)."""
        names = self._names_for(name_or_filter)
        if dir == "bwd":
            names = self._gradient_names(names, explicit=isinstance(name_or_filter, str))
        return [
            self.hook_dict[n].add_hook(fn, dir=dir, is_permanent=is_permanent, prepend=prepend)
            for n in names
        ]

    def _gradient_names(self, names: list[str], explicit: bool) -> list[str]:
        """``names`` less those whose gradient no backward hook can see, which are refused
        when ``explicit`` (named, not matched by a filter) or when nothing else is left."""
        blind = {n for site in self._sites for n in site.gradient_blind}
        refused = [n for n in names if n in blind]
        kept = [n for n in names if n not in blind]
        if refused and (explicit or not kept):
            raise ValueError(
                f"no backward hook can see the gradient of {', '.join(refused)}: qlens rebuilds "
                "these beside the model's own computation (the family's routing reads the "
                "router's logits itself). Hook a name on the model's path, e.g. hook_mlp_out."
            )
        return kept

    def add_perma_hook(
        self, name_or_filter: str | Callable[[str], bool], fn: HookFn, dir: str = "fwd"
    ) -> list[HookHandle]:
        """``add_hook(..., is_permanent=True)``: a hook that ``reset_hooks()`` keeps."""
        return self.add_hook(name_or_filter, fn, dir=dir, is_permanent=True)

    def reset_hooks(
        self,
        clear_contexts: bool = True,
        direction: Literal["fwd", "bwd", "both"] = "both",
        including_permanent: bool = False,
    ) -> None:
        """Remove the hook functions of ``direction`` from every hook point, but permanent ones
        unless ``including_permanent``; clear the points' contexts unless ``clear_contexts``
        is False (TransformerLens' signature, without its context levels)."""
        for point in self.hook_dict.values():
            point.remove_hooks(direction, including_permanent, clear_context=clear_contexts)

    def _add_hooks(
        self,
        handles: list[HookHandle],
        fwd_hooks: Sequence[HookSpec],
        bwd_hooks: Sequence[HookSpec],
    ) -> None:
        """Add the hooks, appending each handle to ``handles`` as it is made, so that the caller
        removes those already added when a later one fails."""
        for target, fn in fwd_hooks:
            handles += self.add_hook(target, fn, "fwd")
        for target, fn in bwd_hooks:
            handles += self.add_hook(target, fn, "bwd")

    @contextlib.contextmanager
    def hooks(
        self, fwd_hooks: Sequence[HookSpec] = (), bwd_hooks: Sequence[HookSpec] = ()
    ) -> Iterator[Bridge]:
        """Hooks active inside the ``with`` block (including backward passes run there)."""
        handles: list[HookHandle] = []
        try:
            self._add_hooks(handles, fwd_hooks, bwd_hooks)
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def hooked_model(self) -> Iterator[nn.Module]:
        """The wrapped Hugging Face model with the active hooks attached for the block: call its
        forward, its ``generate`` or a decode loop of your own (``qlens.StaticDecoder`` does) and
        they fire. Leaving the block detaches them, then raises if an active hook never fired."""
        with self._attached():
            yield self.model
        self._check_fired()

    @contextlib.contextmanager
    def dequantized(self) -> Iterator[Bridge]:
        """Opt in, for the block, to rebuilding quantized weights in float on every weight read.

        Weight-space features (``qlens.weights``, ``qlens.analysis``, ``attn.hook_result``) read
        weights through one guarded layer that refuses packed weights; inside this block they
        get the matrices ``qlens.dequantize`` reconstructs instead. The model is not changed.
        """
        from qlens.weights.access import dequantized

        with dequantized(self):
            yield self

    @contextlib.contextmanager
    def _attached(
        self, stop_at_layer: int | None = None, start: Start | None = None
    ) -> Iterator[None]:
        """Attach PyTorch hooks for the active names (and the attention switch) for one call;
        ``start``: run the layers from its own on, on its residual."""
        if self._running:
            raise RuntimeError(
                "the bridge is already running: a hook cannot run the bridge again; "
                "compute what you need after the forward returns"
            )
        active = {n for n, p in self.hook_dict.items() if p.is_active}
        check_fireable(active, stop_at_layer, None if start is None else start.layer)
        self._check_switches(active)
        handles: list[RemovableHandle | Skipping] = []
        configs = self._attention_configs()
        saved = {id(c): c._attn_implementation for c in configs.values()}
        switch = not active.isdisjoint(self._attention_fn_names)
        for name in active:
            self.hook_dict[name].fired = False
        self._running = True
        try:
            for site in self._sites:
                if site.needed(active):
                    handles += site.attach(self.hook_dict)
            if stop_at_layer is not None:
                handles.append(stop_hook(self._layer_module(stop_at_layer)))
            if start is not None:
                skipped = [rl.layer for rl in self._layers[: start.layer]]
                handles.append(start_hook(self._layer_module(start.layer), skipped, start))
            if switch:
                for rl, tap in zip(self._layers, self._taps, strict=True):
                    attn = rl.modules["attn"]
                    tap.fast_fn = attention.original_attention_fn(attn, saved[id(attn.config)])
                    attention.install_tap(attn, tap)
                for config in configs.values():
                    attention.mask_like_fast_path(config, saved[id(config)])
                    config._attn_implementation = attention.IMPLEMENTATION
            yield
        finally:
            for handle in handles:
                handle.remove()
            for rl in self._layers:
                attention.remove_tap(rl.modules["attn"])
            for config in configs.values():
                attention.forget_mask_style(config)
                if config._attn_implementation != saved[id(config)]:
                    config._attn_implementation = saved[id(config)]
            self._store.clear()
            self._running = False

    def _attention_configs(self) -> dict[int, Any]:
        configs = {id(self.model.config): self.model.config}
        for rl in self._layers:
            config = rl.modules["attn"].config
            configs[id(config)] = config
        return configs

    # -- forward -----------------------------------------------------------------------------
    def _start_from(
        self, residual: Input, start_at_layer: int, attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Start]:
        """Stand-in tokens (the embeddings the skipped layers would have read are replaced),
        the mask, and the start for a forward from ``start_at_layer`` on ``residual``."""
        layer = layer_position(start_at_layer, self.cfg.n_layers, "start_at_layer")
        if not isinstance(residual, Tensor) or not residual.is_floating_point():
            raise TypeError(
                "with start_at_layer, input is the residual stream [batch pos d_model] (a float "
                f"tensor, e.g. cache['resid_pre', {layer}]), got {type(residual).__name__}"
                + (f" of {residual.dtype}" if isinstance(residual, Tensor) else "")
            )
        residual = residual.unsqueeze(0) if residual.ndim == 2 else residual
        if residual.ndim != 3 or residual.shape[-1] != self.cfg.d_model:
            raise ValueError(
                f"with start_at_layer, input must be [batch pos d_model={self.cfg.d_model}], got "
                f"{tuple(residual.shape)}"
            )
        tokens = torch.zeros(residual.shape[:2], dtype=torch.long, device=self.device)
        _, mask = self._prepare(tokens, attention_mask)
        return tokens, mask, Start(layer, residual)

    def _layer_module(self, position: int) -> nn.Module:
        """The module a forward enters at layer ``position`` (``n_layers``: the final norm)."""
        return self.ln_final if position == self.cfg.n_layers else self._layers[position].layer

    def _model_forward(self, tokens: Tensor, mask: Tensor | None) -> Tensor:
        kwargs: dict[str, Any] = {"input_ids": tokens, "use_cache": False}
        if mask is not None:
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = positions_from_mask(mask)
        return self.model(**kwargs).logits

    def _run(
        self,
        tokens: Tensor,
        mask: Tensor | None,
        stop_at_layer: int | None = None,
        start: Start | None = None,
    ) -> Tensor:
        if stop_at_layer is not None:
            stop_at_layer = layer_position(stop_at_layer, self.cfg.n_layers, "stop_at_layer")
            if start is not None and stop_at_layer <= start.layer:
                raise ValueError(
                    f"stop_at_layer ({stop_at_layer}) must come after start_at_layer "
                    f"({start.layer})"
                )
        with self._attached(stop_at_layer, start):
            try:
                out = self._model_forward(tokens, mask)
            except StopForward as stop:
                out = stop.residual
        self._check_fired()
        return out

    def _check_fired(self) -> None:
        silent = [n for n, p in self.hook_dict.items() if p.is_active and not p.fired]
        if silent:
            raise RuntimeError(
                f"hooks did not fire during the forward: {', '.join(silent)}. The model did not "
                "run the modules the adapter maps these names to (qlens.bridge.adapters)."
            )

    def forward(
        self,
        input: Input,
        return_type: Literal["logits", "loss", "both"] | None = "logits",
        attention_mask: Tensor | None = None,
        stop_at_layer: int | None = None,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        loss_per_token: bool = False,
        start_at_layer: int | None = None,
    ) -> Any:
        """Logits ``[batch pos d_vocab]``, the mean next-token loss over real tokens, both, or None.

        With ``stop_at_layer=k`` the residual stream before layer ``k`` is returned instead.
        With ``start_at_layer=j``, ``input`` is the residual stream before layer ``j``
        ``[batch pos d_model]`` (``hook_resid_pre`` of block ``j``; ``n_layers``: before the
        final norm) and only the layers from ``j`` on run; ``attention_mask`` marks its padding.
        Strings are tokenized as ``to_tokens(input, prepend_bos, padding_side)``.
        ``loss_per_token=True`` gives the loss of each prediction ``[batch pos-1]`` instead of the
        mean (0 where the token or its target is padding).
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(
                f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}"
            )
        if start_at_layer is not None:
            if return_type in ("loss", "both"):
                raise ValueError(
                    "start_at_layer runs from a residual, which has no tokens to score: take "
                    "the logits and call loss_fn(logits, tokens)"
                )
            tokens, mask, start = self._start_from(input, start_at_layer, attention_mask)
            out = self._run(tokens, mask, stop_at_layer, start)
            return out if return_type is not None or stop_at_layer is not None else None
        tokens, mask = self._prepare(input, attention_mask, padding_side, prepend_bos)
        out = self._run(tokens, mask, stop_at_layer)
        if stop_at_layer is not None or return_type == "logits":
            return out
        if return_type is None:
            return None
        loss = lm_loss(out, tokens, mask, per_token=loss_per_token)
        return loss if return_type == "loss" else (out, loss)

    __call__ = forward

    def run_block(
        self,
        layer: int,
        resid_pre: Float[Tensor, "batch pos d_model"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Block ``layer`` alone on the residual stream before it (``bridge.blocks[layer]
        (resid_pre)``): its ``resid_post``, the forward from ``start_at_layer=layer`` stopped
        after it. The block's hooks fire; an active hook anywhere else is refused."""
        n = self.cfg.n_layers
        if not -n <= layer < n:
            raise ValueError(f"layer must be in [{-n}, {n - 1}], got {layer}")
        position = layer % n
        outside = sorted(
            name
            for name, point in self.hook_dict.items()
            if point.is_active and layer_of(name) != position
        )
        if outside:
            raise ValueError(
                f"blocks[{position}] runs alone, where hooks outside it cannot fire: "
                f"{', '.join(outside)}. Remove them (reset_hooks()) or run the whole forward."
            )
        return self.forward(
            resid_pre,
            start_at_layer=position,
            stop_at_layer=position + 1,
            attention_mask=attention_mask,
        )

    def loss_fn(
        self,
        logits: Float[Tensor, "batch pos d_vocab"],
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        per_token: bool = False,
    ) -> Float[Tensor, "*batch_pos_minus_1"]:
        """The next-token loss of ``logits`` on ``tokens``, as ``forward(return_type="loss")``
        computes it: the mean over predictions whose token and target ``attention_mask`` keeps
        (all without a mask), or each prediction's ``[batch pos-1]`` (0 where masked)."""
        if tokens.shape != logits.shape[:-1]:
            raise ValueError(
                f"tokens {tuple(tokens.shape)} must be the logits' [batch pos] "
                f"{tuple(logits.shape[:-1])}"
            )
        if attention_mask is not None and attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} must have the tokens' shape "
                f"{tuple(tokens.shape)}"
            )
        return lm_loss(logits, tokens, attention_mask, per_token=per_token)

    def run_with_hooks(
        self,
        input: Input,
        fwd_hooks: Sequence[HookSpec] = (),
        bwd_hooks: Sequence[HookSpec] = (),
        reset_hooks_end: bool = True,
        **forward_kwargs: Any,
    ) -> Any:
        """Run ``forward`` with extra hooks; they are removed afterwards unless ``reset_hooks_end``
        is False (keep them to run a backward pass through ``bwd_hooks``, or use ``hooks()``)."""
        handles: list[HookHandle] = []
        try:
            self._add_hooks(handles, fwd_hooks, bwd_hooks)
            return self.forward(input, **forward_kwargs)
        finally:
            if reset_hooks_end:
                for handle in handles:
                    handle.remove()

    def run_with_cache(
        self,
        input: Input,
        names_filter: NamesFilter = None,
        stop_at_layer: int | None = None,
        remove_batch_dim: bool = False,
        device: str | torch.device | None = None,
        attention_mask: Tensor | None = None,
        return_cache_object: bool = True,
        return_type: Literal["logits", "loss", "both"] | None = "logits",
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        start_at_layer: int | None = None,
        incl_bwd: bool = False,
    ) -> tuple[Any, ActivationCache | dict[str, Tensor]]:
        """Forward while caching (detached) activations. ``names_filter=None`` caches every name
        except the opt-in ``attn.hook_result`` (and those a ``stop_at_layer`` or
        ``start_at_layer`` forward does not reach). ``incl_bwd=True`` then runs ``backward()``
        on the output (one number: ``return_type="loss"``, or ``"both"``, whose loss it takes)
        and caches the gradient of each name's activation as ``name + "_grad"`` (names
        whose gradient no hook can see, the MoE router's, are left out, or refused when
        named); parameters' ``.grad`` accumulate as in any backward pass."""
        if incl_bwd and not torch.is_grad_enabled():
            raise RuntimeError(
                "incl_bwd=True runs a backward pass: call run_with_cache outside torch.no_grad() "
                "and torch.inference_mode()"
            )
        names = resolve_names(names_filter, self.hook_names)
        if callable(names_filter):  # switched-off names are left out, as they cannot fire
            names = [n for n in names if not self._switched_off(n)]
        if names_filter is None:
            selected = set(names) | set(self._switched_on_names())
            names = [n for n in self.hook_names if n in selected]
        if names_filter is None and stop_at_layer is not None:  # every name that can fire
            stop = layer_position(stop_at_layer, self.cfg.n_layers, "stop_at_layer")
            names = [n for n in names if fires_before(n, stop)]
        if names_filter is None and start_at_layer is not None:
            start = layer_position(start_at_layer, self.cfg.n_layers, "start_at_layer")
            names = [n for n in names if fires_from(n, start)]
        store: dict[str, Tensor] = {}

        def kept(x: Tensor) -> Tensor:
            return x.detach() if device is None else x.detach().to(device)

        def save(x: Tensor, hook: HookPoint) -> None:
            store[hook.name] = kept(x)

        def save_grad(grad: Tensor, hook: HookPoint) -> None:
            store[hook.name + "_grad"] = kept(grad)

        handles = [self.hook_dict[n].add_hook(save) for n in names]
        if incl_bwd:
            named = isinstance(names_filter, str | list | tuple)
            gradient_names = self._gradient_names(names, explicit=named)
            handles += [self.hook_dict[n].add_hook(save_grad, "bwd") for n in gradient_names]
        try:
            out = self.forward(
                input,
                return_type,
                attention_mask,
                stop_at_layer,
                prepend_bos,
                padding_side,
                start_at_layer=start_at_layer,
            )
            if incl_bwd:
                _backward_from(out[1] if return_type == "both" else out)
                _require_gradients(store, gradient_names)
        finally:
            for handle in handles:
                handle.remove()
        if remove_batch_dim:
            store = {k: v[0] for k, v in _require_batch_one(store).items()}
        if not return_cache_object:
            return out, store
        cache = ActivationCache(store, self.cfg.n_layers, not remove_batch_dim, bridge=self)
        return out, cache

    @torch.no_grad()
    def generate(
        self,
        input: Input,
        max_new_tokens: int = 10,
        do_sample: bool = False,
        return_type: Literal["input", "tokens", "str"] = "input",
        prepend_bos: bool | None = None,
        padding_side: PaddingSide = "left",
        *,
        stop_at_eos: bool = True,
        eos_token_id: int | list[int] | None = None,
        use_past_kv_cache: bool = True,
        freq_penalty: float = 0.0,
        verbose: bool = False,
        **generate_kwargs: Any,
    ) -> Any:
        """Generate with the active hooks firing at every step (they see the new tokens).

        Strings are tokenized as ``to_tokens(input, prepend_bos, padding_side)``; batched
        strings are left-padded by default. Returns the same kind as the input (``"input"``),
        token ids ``[batch pos]`` (``"tokens"``) or strings (``"str"``); strings are decoded
        without special tokens, so a prepended BOS does not appear in them. TransformerLens'
        keywords are understood (see ``qlens.bridge.generation``); ``temperature``, ``top_k``,
        ``top_p``, ``repetition_penalty`` and other keywords go to the HF model's ``generate``.
        """
        mask_arg = generate_kwargs.pop("attention_mask", None)
        tokens, mask = self._prepare(input, mask_arg, padding_side, prepend_bos)
        if mask is None:
            mask = torch.ones_like(tokens)
        pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        generate_kwargs.setdefault(
            "pad_token_id", pad if pad is not None else (eos if isinstance(eos, int) else 0)
        )
        hf_kwargs, progress = hf_generate_kwargs(
            generate_kwargs,
            max_new_tokens=max_new_tokens,
            stop_at_eos=stop_at_eos,
            eos_token_id=eos_token_id,
            use_past_kv_cache=use_past_kv_cache,
            freq_penalty=freq_penalty,
            verbose=verbose,
        )
        try:
            with self.hooked_model() as model:
                generate = cast(Callable[..., Tensor], model.generate)
                out = generate(
                    input_ids=tokens,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=do_sample,
                    **hf_kwargs,
                )
        finally:
            if progress is not None:
                progress.bar.close()
        if return_type == "str" or (return_type == "input" and isinstance(input, (str, list))):
            from_strings = isinstance(input, (str, list))
            bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
            strings = self._decode_generated(out, mask if from_strings and bos else None)
            return strings[0] if isinstance(input, str) else strings
        return out


def guard_compiled_graphs_on_hooks() -> None:
    """Make every compiled graph record whether each module had PyTorch hooks when traced.

    A bridge attaches its hooks to the model for each call only. By default dynamo does not
    guard on a module's empty hook dicts, so a graph traced with no bridge hook active would
    later run in place of one with the hooks, which would then silently not fire. With this
    (process-wide) setting a change of the hook set recompiles, and returning to a hook set
    reuses its graph; the guards cost a length check per hook dict.
    """
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False


def _backward_from(out: Any) -> None:
    """``out.backward()`` for ``run_with_cache(incl_bwd=True)``, refusing what it cannot run."""
    if not isinstance(out, Tensor) or out.numel() != 1:
        got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            "incl_bwd=True runs backward() from the forward's output, which must be one number: "
            f"pass return_type='loss' (got {got})"
        )
    if not out.requires_grad:
        raise RuntimeError(
            "incl_bwd=True: the output does not require grad, so no gradient can flow (are the "
            "model's parameters frozen? model.requires_grad_(True) on some of them)"
        )
    out.backward()


def _require_gradients(store: dict[str, Tensor], names: list[str]) -> None:
    """Every cached activation of ``names`` got its gradient, or the error says which not."""
    missing = [n for n in names if n in store and n + "_grad" not in store]
    if missing:
        raise RuntimeError(
            f"no gradient reached {', '.join(missing)}: their activations do not require grad "
            "(frozen parameters before them?) or do not reach the output"
        )


def _require_batch_one(store: dict[str, Tensor]) -> dict[str, Tensor]:
    for name, value in store.items():
        if value.shape[0] != 1:
            raise ValueError(
                f"remove_batch_dim=True needs a batch of one, but {name} has batch {value.shape[0]}"
            )
    return store
