"""The two terms of an MoE block with a shared expert (Qwen2-MoE): routed and shared.

HF computes ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` on
token-flattened ``[batch*pos d_model]`` rows. ``mlp.hook_routed_out`` fires on the experts'
output, and what it returns enters the sum. ``mlp.hook_shared_expert_out`` fires on the gated
shared expert, computed from the outputs of the shared expert and of its gate with HF's own
operations; while it is hooked the block returns ``routed + shared`` of the hooked tensors,
which is bit-identical to HF's sum when nothing is edited and carries edits and gradients
when something is. Both are shown as ``[batch pos d_model]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qlens.bridge.taps import Points, Site


class SharedExpertSite(Site):
    """``mlp.hook_routed_out`` and ``mlp.hook_shared_expert_out`` of one MoE block.

    ``shared_out`` is the module whose output is the shared expert's (ungated) output;
    ``shared_gate`` the ``Linear(d_model, 1)`` whose sigmoid scales it.
    """

    def __init__(
        self,
        mlp: nn.Module,
        experts: nn.Module,
        shared_out: nn.Module,
        shared_gate: nn.Module,
        routed_name: str,
        shared_name: str,
    ) -> None:
        self.mlp, self.experts = mlp, experts
        self.shared_out, self.shared_gate = shared_out, shared_gate
        self.names = (routed_name, shared_name)

    def attach(self, points: Points) -> list[RemovableHandle]:
        routed_point, shared_point = (points[name] for name in self.names)
        # of the block call in progress: its [batch pos], the routed term the sum will use, the
        # ungated shared expert output, then the (hooked) gated one
        seen: dict[str, Any] = {}
        shared_hooked = shared_point.is_active  # the block then returns the hooked sum

        def record_shape(_m: nn.Module, args: tuple[Any, ...]) -> None:
            seen["shape"] = args[0].shape[:-1]

        def routed_hook(_m: nn.Module, _args: Any, output: Tensor) -> Tensor:
            if routed_point.is_active:
                output = routed_point(output.reshape(*seen["shape"], -1)).reshape(output.shape)
            if shared_hooked:
                seen["routed"] = output
            return output

        def record_shared(_m: nn.Module, _args: Any, output: Tensor) -> None:
            seen["shared"] = output

        def gate_hook(_m: nn.Module, _args: Any, output: Tensor) -> None:
            gated = torch.sigmoid(output) * seen.pop("shared")  # as HF scales it
            seen["gated"] = shared_point(gated.reshape(*seen["shape"], -1)).reshape(gated.shape)

        def rebuild_sum(_m: nn.Module, _args: Any, output: Tensor) -> Tensor:
            return (seen.pop("routed") + seen.pop("gated")).reshape(output.shape)

        handles = [
            self.mlp.register_forward_pre_hook(record_shape),
            self.experts.register_forward_hook(routed_hook),
        ]
        if shared_hooked:
            handles += [
                self.shared_out.register_forward_hook(record_shared),
                self.shared_gate.register_forward_hook(gate_hook),
                self.mlp.register_forward_hook(rebuild_sum),
            ]
        return handles
