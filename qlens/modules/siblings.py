"""Sibling QuantLinears that read the same row share one launch in eager decode.

Attention runs ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` on one tensor ``h``, an MLP
``gate_proj(h)`` and ``up_proj(h)``. At one row (eager decode, batch 1) each is a GEMV whose
host cost, not its GPU time, sets the pace. A :class:`SiblingGroup` lets the first sibling
compute every sibling's product in one launch (``qlens.kernels.sibling_gemv``) and keep the
others' outputs; the next sibling called with the same tensor, unmodified since
(``_version``), takes its output instead of launching. Anything else (another tensor, an
edited one, several rows, autograd, inference-mode tensors without a version counter,
``torch.compile``, the CPU reference) runs each module on its own. The shared launch runs
the single-weight GEMV's program on each weight, with the tile chosen for the stacked width:
the same products, summed in the order of that tile.

Every forward still runs and every hook still fires: only the kernel launch is shared.
``qlens.quantize`` and ``qlens.load`` (the Bridge) group siblings; :func:`group_siblings` and
:func:`ungroup_siblings` do it by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from operator import is_
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from qlens.kernels.dispatch import ACTIVATION_DTYPES

if TYPE_CHECKING:
    from qlens.kernels.sibling_gemv import SiblingGemv
    from qlens.modules.linear import QuantLinear

logger = logging.getLogger(__name__)
Buffers = tuple[Tensor | None, ...]  # the members' payload buffers, in member order

# Children of one module that HF models call on the same tensor, first-called first.
SIBLING_NAMES: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


class SiblingGroup:
    """Two or three QuantLinears of one format and input size, called on the same tensor.

    ``members[0]`` launches for all (:meth:`output`); the launch is prepared per device and
    activation dtype and rebuilt when a member's payload buffers are replaced (``.to()``,
    ``load_state_dict``, device maps). Buffers replaced between nearly every call (offloading
    hooks) stop the sharing for good: the group then costs one check a call.
    """

    def __init__(self, members: Sequence[QuantLinear]) -> None:
        self.members = tuple(members)
        # (device, dtype), the members' payload buffers it was built on, the launch or None
        self._kept: tuple[tuple[torch.device, torch.dtype], Buffers, SiblingGemv | None] | None
        self._kept = None
        self._served = 0  # shared launches since the last build
        self._stopped = False
        # The tensor the last shared launch read, its version, then each member's output
        # still to be taken (None once taken, and for the first member).
        self._pending: list[object] | None = None
        for index, member in enumerate(self.members):
            member._sibling_group, member._sibling_index = self, index

    def output(self, index: int, x: Tensor) -> Tensor | None:
        """Member ``index``'s output for ``x``: taken from the last shared launch, launched for
        all members (the first member, one row), or None: the member runs on its own."""
        pending = self._pending
        if pending is not None and pending[0] is x:
            out = pending[index + 2]
            if out is not None and not x.is_inference() and pending[1] == x._version:
                pending[index + 2] = None
                return out  # type: ignore[return-value]
        if index or x.is_inference() or x.numel() != x.shape[-1]:
            return None
        if x.requires_grad and torch.is_grad_enabled():
            return None
        launch = self._launch_for(x)
        if launch is None:
            return None
        self._served += 1
        biases = [m.bias for m in self.members] if launch.has_bias else None
        outputs = launch(x if x.is_contiguous() else x.contiguous(), biases)  # type: ignore[arg-type]  # noqa: E501
        self._pending = [x, x._version, None, *outputs[1:]]
        return outputs[0]

    def forget(self) -> None:
        """Drop the prepared launch and any kept outputs (rebuilt on the next call)."""
        self._kept = None
        self._pending = None

    def _launch_for(self, x: Tensor) -> SiblingGemv | None:
        if self._stopped:
            return None
        buffers = tuple(
            m._buffers[name] for m in self.members for name in m._payload_buffers["weight"]
        )
        key = (x.device, x.dtype)
        kept = self._kept
        if kept is not None and kept[0] == key and all(map(is_, buffers, kept[1])):
            return kept[2]
        if kept is not None and self._served < 2:  # rebuilt before it served: thrashing
            self._stopped = True
            self.forget()
            return None
        self._served = 0
        self._pending = None
        launch = self._build(x, buffers)
        self._kept = (key, buffers, launch)
        return launch

    def _build(self, x: Tensor, buffers: Buffers) -> SiblingGemv | None:
        if x.dtype not in ACTIVATION_DTYPES or any(
            b is None or b.device != x.device for b in buffers
        ):
            return None
        w8a8 = {m.w8a8 for m in self.members}
        if len(w8a8) > 1:  # FP8 activations for some: the numerics differ
            return None
        round_x = w8a8.pop()
        plans = [m.linear_plan("weight", x, round_x) for m in self.members]
        from qlens.kernels.sibling_gemv import plans_gemv  # Triton: a launch is prepared

        has_bias = self.members[0].bias is not None
        built = plans_gemv(plans, x.dtype, has_bias, x.device, round_x)
        if isinstance(built, str):
            logger.debug("%s: no shared launch: %s", self, built)
            return None
        return built

    def __reduce__(self) -> tuple[object, tuple[()]]:
        # A copied or pickled member does not share launches (its siblings may not come along):
        # group_siblings, qlens.quantize or qlens.load group a copied model again.
        return _no_group, ()

    def __repr__(self) -> str:
        shapes = ", ".join(f"{m.out_features}x{m.in_features}" for m in self.members)
        return f"SiblingGroup({shapes})"


def _no_group() -> None:
    return None


def _can_share(members: Sequence[nn.Module]) -> bool:
    from qlens.modules.linear import QuantLinear

    if not all(type(m) is QuantLinear for m in members):
        return False
    linears = cast(Sequence[QuantLinear], members)
    first, fmt = linears[0], linears[0]._payload_specs["weight"].format
    return all(
        m.in_features == first.in_features
        and m._payload_specs["weight"].format == fmt
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )


def group_siblings(model: nn.Module) -> list[SiblingGroup]:
    """Group the QuantLinear siblings of every module of ``model`` (``SIBLING_NAMES``: q/k/v
    projections, gate/up) that share a format and input size, replacing earlier groups."""
    groups = []
    for parent in model.modules():
        children = parent._modules
        for names in SIBLING_NAMES:
            members = [children.get(name) for name in names]
            if all(m is not None for m in members) and _can_share(members):  # type: ignore[arg-type]  # noqa: E501
                groups.append(SiblingGroup(members))  # type: ignore[arg-type]
    return groups


def ungroup_siblings(model: nn.Module) -> int:
    """Make every QuantLinear of ``model`` launch on its own again; returns how many were
    grouped."""
    from qlens.modules.linear import QuantLinear

    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and module._sibling_group is not None:
            module._sibling_group, module._sibling_index = None, 0
            count += 1
    return count
