"""Module-boundary taps: PyTorch hooks that feed HF activations through qlens HookPoints.

Each site serves a few canonical names and is attached (as forward hooks / pre-hooks) only
while one of them is active, so an idle bridge leaves the HF model untouched.

Backward hooks see the gradient of the loss with respect to the hooked activation. A site
that shows a view of the model's tensor passes that view on while a backward hook is on it
(the gradient then reaches the view); one that computes its activation beside the model's
own computation (a norm's scale, ``resid_mid``, per-head results) shows a detached copy
and ties it into the module's output with a term that is zero in value and carries the
copy's exact gradient (``observed``, ``tied``). Names whose gradient no site can show are a
site's ``gradient_blind``; backward hooks on them are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge.routing import dense_router_weights, sparse_router_weights
from qlens.hooks import HookPoint, mark_side_computation

Points = dict[str, HookPoint]


def _first(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_first(output: Any, value: Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def wants_grad(points: Points, *names: str) -> bool:
    """Whether a backward hook waits on any of ``names`` in a forward that records gradients."""
    if not torch.is_grad_enabled():
        return False
    return any((point := points.get(name)) is not None and bool(point.bwd_hooks) for name in names)


def observed(x: Tensor) -> Tensor:
    """A detached copy of a side computation that records the gradient ``tied`` gives it
    (backward hooks may read that gradient, not replace it: ``mark_side_computation``)."""
    return mark_side_computation(x.detach().requires_grad_(True))


def tied(out: Tensor, side: Tensor) -> Tensor:
    """``out`` (unchanged in value: ``side - side`` is zero) with ``side`` on its gradient
    path, so ``side`` receives the gradient ``out`` receives, through ``side``'s own function
    of the observed copies."""
    return out + (side - side.detach()).to(out.dtype)


def _fire_side(
    points: Points, name: str, x: Tensor, shape: Callable[[], tuple[int, ...]] | None
) -> tuple[Tensor, bool]:
    """Run the named point on ``x``, a side computation (shown as ``_fire`` shows it, and as an
    ``observed`` copy while a backward hook waits on it): what the hooks left, in ``x``'s
    shape, and whether they left the activation unchanged (then the copy itself, for
    ``tied``; ``x`` when no gradient is wanted)."""
    point = points.get(name)
    if point is None or not point.is_active:
        return x, True
    shaped = _as_shown(x, shape)
    grad = wants_grad(points, name)
    if grad:
        shaped = observed(shaped)
    new = point(shaped)
    if new is shaped and not grad:
        return x, True
    return new.reshape(x.shape), new is shaped


def _fire(
    points: Points, name: str | None, x: Tensor, shape: Callable[[], tuple[int, ...]] | None = None
) -> Tensor:
    """Run the named point on ``x``; token-flattened 2-D tensors are shown as [batch pos ...]."""
    point = points.get(name) if name is not None else None
    if point is None or not point.is_active:
        return x
    shaped = _as_shown(x, shape)
    new = point(shaped)
    if shaped is x:
        return new
    keep = new is shaped and not wants_grad(points, point.name)
    return x if keep else new.reshape(x.shape)


def _as_shown(x: Tensor, shape: Callable[[], tuple[int, ...]] | None) -> Tensor:
    """``x`` as hooks see it: a token-flattened 2-D tensor as [batch pos ...] when ``shape``
    gives [batch pos], else ``x`` itself."""
    if shape is not None and x.ndim == 2:
        shaped = x.reshape(*shape(), x.shape[-1])
        if shaped.ndim == 3:
            return shaped
    return x


def norm_eps(module: nn.Module) -> float:
    """The epsilon of a LayerNorm / RMSNorm module, whatever the family calls it."""
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attr, None)
        if value is not None:
            return float(value)
    raise AttributeError(f"cannot find the epsilon of norm module {type(module).__name__}")


class Site:
    """Serves ``names``; ``attach`` registers its PyTorch hooks and returns their handles."""

    names: tuple[str, ...] = ()
    also_needed_by: tuple[str, ...] = ()
    # names whose gradient backward hooks cannot see (see the module's docstring)
    gradient_blind: tuple[str, ...] = ()
    # [batch pos] of the current layer, for families that flatten tokens (OPT's MLP)
    shape: Callable[[], tuple[int, ...]] | None = None

    def needed(self, active: set[str]) -> bool:
        return any(n in active for n in self.names + self.also_needed_by)

    def attach(self, points: Points) -> list[RemovableHandle]:
        raise NotImplementedError


class OutputSite(Site):
    """A module's output (first element when the module returns a tuple)."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.names = module, (name,)

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]

        def hook(_m: nn.Module, _args: Any, output: Any) -> Any:
            new = _fire(points, name, _first(output), self.shape)
            return _with_first(output, new)

        return [self.module.register_forward_hook(hook)]


class PositionEmbeddingSite(Site):
    """``hook_pos_embed`` [batch pos d_model]: the learned position embedding, one row per
    sequence as in TransformerLens (GPT-2 computes it once, [1 pos d_model], and broadcasts).

    The batch size comes from the model call's ``input_ids`` / ``inputs_embeds``.
    """

    def __init__(self, model: nn.Module, module: nn.Module, name: str) -> None:
        self.model, self.module, self.names = model, module, (name,)

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]
        batch: list[int] = []  # of the current model call

        def record_batch(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
            if tokens is None:
                tokens = kwargs.get("inputs_embeds")
            batch[:] = [tokens.shape[0]] if isinstance(tokens, Tensor) and tokens.ndim >= 2 else []

        def hook(_m: nn.Module, _args: Any, output: Any) -> Any:
            x = _first(output)
            if batch and x.ndim == 3 and x.shape[0] == 1 != batch[0]:
                x = x.expand(batch[0], -1, -1).contiguous()
            return _with_first(output, _fire(points, name, x, self.shape))

        return [
            self.model.register_forward_pre_hook(record_batch, with_kwargs=True),
            self.module.register_forward_hook(hook),
        ]


class InputSite(Site):
    """A module's first positional input."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.names = module, (name,)

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]

        def hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (_fire(points, name, args[0], self.shape), *args[1:])

        return [self.module.register_forward_pre_hook(hook)]


class LayerInputSite(Site):
    """``hook_resid_pre`` at a decoder layer's input; remembers it for ``hook_resid_mid``."""

    def __init__(self, layer: nn.Module, name: str, store: dict[str, Tensor]) -> None:
        self.layer, self.names, self.store = layer, (name,), store
        self.also_needed_by: tuple[str, ...] = ()  # set to every name of the layer

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                x = _fire(points, name, args[0])
                args = (x, *args[1:])
            else:
                x = kwargs["hidden_states"] = _fire(points, name, kwargs["hidden_states"])
            self.store[name] = x
            return args, kwargs

        return [self.layer.register_forward_pre_hook(hook, with_kwargs=True)]


class ResidMidSite(Site):
    """``hook_resid_mid`` = resid_pre + the attention branch output added to the residual.

    An edit to resid_mid is applied by replacing the branch output with ``new - resid_pre``.
    """

    def __init__(self, module: nn.Module, name: str, store: dict[str, Tensor], pre: str) -> None:
        self.module, self.names, self.store, self.pre = module, (name,), store, pre

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]

        def hook(_m: nn.Module, _args: Any, output: Any) -> Any:
            resid_pre = self.store[self.pre]
            branch = _first(output)
            mid = resid_pre + branch
            grad = wants_grad(points, name)
            if grad:  # the model adds the branch to the residual itself: d mid = d branch
                mid = observed(mid)
            new_mid = _fire(points, name, mid)
            if new_mid is mid:
                return _with_first(output, tied(branch, mid)) if grad else output
            return _with_first(output, new_mid - resid_pre)

        return [self.module.register_forward_hook(hook)]


class NormSite(Site):
    """``<prefix>.hook_scale`` [batch pos 1], ``hook_normalized`` and ``hook_out`` [batch pos d].

    As in TransformerLens: the scale is sqrt(var + eps) (LayerNorm) or sqrt(mean(x^2) + eps)
    (RMSNorm), computed and shown in float32 (for bf16/fp16 models too) from the norm's input; ``hook_normalized`` is the (centered)
    input divided by it, before the weight; ``hook_out`` is the norm module's output. Editing the
    scale or the normalized input rebuilds the output as ``normalized * weight + bias``
    (``1 + weight`` where the family offsets it).
    """

    def __init__(self, module: nn.Module, prefix: str, rms: bool, weight_offset: float) -> None:
        self.module, self.rms, self.eps = module, rms, norm_eps(module)
        self.weight_offset = weight_offset
        self.names = (f"{prefix}.hook_scale", f"{prefix}.hook_normalized", f"{prefix}.hook_out")

    def centered_and_variance(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The norm's float32 (centered) input and its ``mean(x^2) + eps`` ``[... 1]``."""
        x = x.float()
        if not self.rms:
            x = x - x.mean(-1, keepdim=True)
        return x, x.pow(2).mean(-1, keepdim=True).add_(self.eps)

    def affine(self, normalized: Tensor, dtype: torch.dtype) -> Tensor:
        """``normalized * weight + bias`` in float32, as the HF norms apply them."""
        weight = getattr(self.module, "weight", None)
        y = normalized.float()
        if weight is not None:
            y = y * (weight.float() + self.weight_offset)
        bias = getattr(self.module, "bias", None)
        if bias is not None and not self.rms:
            y = y + bias.float()
        return y.to(dtype)

    def attach(self, points: Points) -> list[RemovableHandle]:
        scale_name, normalized_name, out_name = self.names

        def hook(_m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            y = _first(output)
            if points[scale_name].is_active or points[normalized_name].is_active:
                centered, variance = self.centered_and_variance(args[0])
                scale = variance.sqrt()  # float32 for every model dtype, as in TransformerLens
                scale, scale_kept = _fire_side(points, scale_name, scale, self.shape)
                if scale_kept:  # x * rsqrt(var + eps), as the HF norms compute it
                    normalized = centered * variance.rsqrt()
                else:
                    normalized = centered / scale.float()
                normalized, normalized_kept = _fire_side(
                    points, normalized_name, normalized, self.shape
                )
                if not (scale_kept and normalized_kept):
                    y = self.affine(normalized, y.dtype)
                else:  # the output as the model computed it, carrying the observed gradients
                    if wants_grad(points, normalized_name):
                        y = tied(y, self.affine(normalized, y.dtype))
                    if wants_grad(points, scale_name):
                        y = tied(y, self.affine(centered.detach() / scale, y.dtype))
            y = _fire(points, out_name, y, self.shape)
            return _with_first(output, y)

        return [self.module.register_forward_hook(hook)]


class GateUpSite(Site):
    """A fused gate/up projection: ``hook_pre`` = gate half, ``hook_pre_linear`` = up half."""

    def __init__(self, module: nn.Module, pre: str, pre_linear: str) -> None:
        self.module, self.names = module, (pre, pre_linear)

    def attach(self, points: Points) -> list[RemovableHandle]:
        pre, pre_linear = self.names

        def hook(_m: nn.Module, _args: Any, output: Tensor) -> Tensor:
            gate, up = output.chunk(2, dim=-1)
            new_gate = _fire(points, pre, gate, self.shape)
            new_up = _fire(points, pre_linear, up, self.shape)
            if new_gate is gate and new_up is up and not wants_grad(points, pre, pre_linear):
                return output
            return torch.cat([new_gate, new_up], dim=-1)

        return [self.module.register_forward_hook(hook)]


class RouterSite(Site):
    """MoE router: ``hook_router_logits`` [batch pos n_experts] and ``hook_router_weights``.

    ``hook_router_weights`` is dense [batch pos n_experts]: the mixing weight of each selected
    expert, 0 elsewhere. Editing the logits re-runs the family's routing on the new logits;
    editing the weights changes the mixing of the selected experts.
    """

    def __init__(
        self,
        mlp: nn.Module,
        router: nn.Module,
        logits_name: str,
        weights_name: str,
        routing: Callable[[Tensor], tuple[Tensor, Tensor]],
    ) -> None:
        self.mlp, self.router, self.routing = mlp, router, routing
        self.names = (logits_name, weights_name)
        # the family's routing reads the router's own logits; the weights are rebuilt dense
        self.gradient_blind = self.names
        self._shape: tuple[int, ...] = ()

    def attach(self, points: Points) -> list[RemovableHandle]:
        logits_name, weights_name = self.names

        def record_shape(_m: nn.Module, args: tuple[Any, ...]) -> None:
            self._shape = tuple(args[0].shape[:-1])

        def hook(_m: nn.Module, _args: Any, output: tuple[Tensor, Tensor, Tensor]) -> Any:
            logits, scores, indices = output
            shaped = logits.reshape(*self._shape, logits.shape[-1])
            new_logits = _fire(points, logits_name, shaped)
            if new_logits is not shaped:
                logits = new_logits.reshape(logits.shape)
                scores, indices = self.routing(logits)
                scores = scores.to(output[1].dtype)
            point = points.get(weights_name)
            if point is not None and point.is_active:
                dense = dense_router_weights(scores, indices, logits.shape[-1])
                shaped_dense = dense.reshape(*self._shape, -1)
                new_dense = point(shaped_dense)
                if new_dense is not shaped_dense:
                    scores = sparse_router_weights(
                        new_dense.reshape(dense.shape), indices, weights_name
                    )
            return logits, scores, indices

        return [
            self.mlp.register_forward_pre_hook(record_shape),
            self.router.register_forward_hook(hook),
        ]


class ResultSite(Site):
    """``attn.hook_result`` [batch pos head d_model]: each head's output through o_proj.

    Reads the o_proj weight through the guarded accessor layer (``qlens.weights.access``), so a
    quantized o_proj raises unless the user opted into dequantization (``bridge.dequantized()``);
    the bias is not included. Editing the result replaces the attention output by the sum over
    heads plus the bias.
    """

    def __init__(self, o_proj: nn.Module, name: str, n_heads: int, owner: nn.Module) -> None:
        self.module, self.names, self.n_heads, self.owner = o_proj, (name,), n_heads, owner

    def w_o(self) -> Tensor:
        from qlens.weights.access import read_weight

        weight = read_weight(
            self.module,
            operation="compute per-head attention results (hook_result)",
            owner=self.owner,
        )  # [d_model, head*d_head]
        w = weight.T
        return w.reshape(self.n_heads, -1, w.shape[-1])

    def attach(self, points: Points) -> list[RemovableHandle]:
        name = self.names[0]

        def hook(_m: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
            z = args[0].reshape(*args[0].shape[:-1], self.n_heads, -1)
            w_o = self.w_o().to(z.dtype)
            result = torch.einsum("...hd,hdm->...hm", z, w_o)
            grad = wants_grad(points, name)
            if grad:  # the output is the heads' sum (and the bias): d result_h = d output
                result = observed(result)
            new = points[name](result)
            if new is result:
                return tied(output, result.sum(-2)) if grad else output
            bias = getattr(self.module, "bias", None)
            summed = new.sum(-2)
            return summed + bias if bias is not None else summed

        return [self.module.register_forward_hook(hook)]
