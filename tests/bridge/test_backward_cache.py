"""``run_with_cache(incl_bwd=True)``: the gradient of the loss with respect to each cached
activation, as TransformerLens caches it (``name + "_grad"``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from bridge_models import tiny_model

from qlens import Bridge

TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 4, 5, 6], [1, 6, 6, 7, 8, 5, 4, 5, 6]])
NAMES = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post"]


def _autograd_grads(
    bridge: Bridge, names: list[str]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and each activation's gradient by autograd on activations kept by forward
    hooks (the oracle)."""
    kept: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook) -> None:
        kept[hook.name] = x

    loss = bridge.run_with_hooks(TOKENS, [(name, keep) for name in names], return_type="loss")
    grads = torch.autograd.grad(loss, [kept[name] for name in names])
    return loss, dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_cached_gradients_are_the_losss_gradients(arch: str) -> None:
    bridge = Bridge(tiny_model(arch))
    names = [n for n in NAMES if n in bridge.hook_dict]
    loss, expected = _autograd_grads(bridge, names)
    bridge.zero_grad()
    out, cache = bridge.run_with_cache(
        TOKENS, names_filter=names, return_type="loss", incl_bwd=True
    )
    assert torch.equal(out.detach(), loss.detach())
    assert set(cache.keys()) == {*names, *(n + "_grad" for n in names)}
    for name in names:
        assert torch.equal(cache[name + "_grad"], expected[name]), name
        assert cache[name + "_grad"].shape == cache[name].shape
    assert torch.equal(cache["resid_post_grad", 0], expected["blocks.0.hook_resid_post"])
    assert any(p.grad is not None for p in bridge.parameters())  # a real backward pass ran
    assert not any(p.is_active for p in bridge.hook_dict.values())
    _, both = bridge.run_with_cache(TOKENS, names_filter=names, return_type="both", incl_bwd=True)
    assert torch.equal(both["blocks.0.hook_resid_post_grad"], expected["blocks.0.hook_resid_post"])


def test_a_backward_cache_refuses_what_has_no_gradient() -> None:
    bridge = Bridge(copy.deepcopy(tiny_model("llama")))  # its parameters get frozen below
    with pytest.raises(ValueError, match=r"must be one number: pass return_type='loss' \(got sh"):
        bridge.run_with_cache(TOKENS, names_filter=NAMES[:2], incl_bwd=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="outside torch.no_grad"):
        bridge.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)
    bridge.requires_grad_(False)
    with pytest.raises(RuntimeError, match="does not require grad.*frozen"):
        bridge.run_with_cache(TOKENS, names_filter=NAMES[:2], return_type="loss", incl_bwd=True)
    assert not any(p.is_active for p in bridge.hook_dict.values())


# Activations qlens computes beside the model's own computation or shows as views of it
# (norm scale and normalized input, resid_mid, per-head results, q/k of the projections, the
# fused gate/up halves), and one on the model's path, per family.
FD_NAMES = {
    "llama": [
        "blocks.0.hook_resid_mid",
        "blocks.0.ln2.hook_normalized",
        "blocks.0.ln2.hook_scale",
        "blocks.0.attn.hook_result",
        "blocks.0.attn.hook_q",
        "blocks.1.hook_resid_pre",
    ],
    "opt": ["blocks.0.ln2.hook_scale", "blocks.0.ln2.hook_normalized", "blocks.0.mlp.hook_pre"],
    "phi3": ["blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_pre_linear", "blocks.0.attn.hook_k"],
}


@pytest.mark.parametrize("arch", sorted(FD_NAMES))
def test_cached_gradients_match_finite_differences(arch: str) -> None:
    """The cached gradient ``g`` of each activation against a central difference of the loss
    along ``u = g / |g|`` (the activation patched to ``x +- eps u``), which is ``|g|`` when
    ``g`` is the gradient; a gradient missing a path or scaled wrongly is off by O(1). The
    model runs in float64 but its norms in float32 (as HF computes them), so the difference
    carries float32 rounding: at eps 1e-3 it agreed within 0.3% here; the test allows 2%."""
    bridge = Bridge(copy.deepcopy(tiny_model(arch)).double())
    if any(name.endswith("hook_result") for name in FD_NAMES[arch]):
        bridge.set_use_attn_result(True)
    _, cache = bridge.run_with_cache(
        TOKENS, names_filter=FD_NAMES[arch], return_type="loss", incl_bwd=True
    )
    for name in FD_NAMES[arch]:
        grad = cache[name + "_grad"]
        direction = grad / grad.norm()

        def loss(eps: float, name: str = name, direction: torch.Tensor = direction) -> float:
            with torch.no_grad():
                logits = bridge.run_with_hooks(
                    TOKENS, [(name, lambda x, hook: x + eps * direction)]
                )
                predictions = logits[:, :-1].flatten(0, 1)
                return F.cross_entropy(predictions, TOKENS[:, 1:].flatten()).item()

        eps = 1e-3
        finite = (loss(eps) - loss(-eps)) / (2 * eps)
        assert grad.norm().item() == pytest.approx(finite, rel=2e-2), name


def test_router_gradients_are_refused_by_name_and_left_out_by_filters() -> None:
    """The MoE router's logits and weights are rebuilt beside the routing the family runs, so
    no gradient reaches them: a backward hook on one is refused, a filter leaves them out,
    and a whole backward cache holds every other name's gradient."""
    bridge = Bridge(tiny_model("qwen3_moe"))
    with pytest.raises(ValueError, match=r"gradient of blocks\.0\.mlp\.hook_router_logits"):
        bridge.add_hook("blocks.0.mlp.hook_router_logits", lambda g, hook: None, dir="bwd")
    with pytest.raises(ValueError, match=r"hook_router_weights.*hook_mlp_out"):
        bridge.run_with_cache(
            TOKENS,
            names_filter=["blocks.0.mlp.hook_router_weights"],
            return_type="loss",
            incl_bwd=True,
        )
    handles = bridge.add_hook(lambda name: "mlp" in name, lambda g, hook: None, dir="bwd")
    assert handles and not any("router" in h.point.name for h in handles)
    bridge.reset_hooks()
    _, cache = bridge.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)
    activations = [k for k in cache.keys() if not k.endswith("_grad")]
    assert {k for k in cache.keys() if k.endswith("_grad")} == {
        k + "_grad" for k in activations if "router" not in k
    }


def test_a_backward_hook_on_a_side_computed_name_sees_and_edits_its_gradient() -> None:
    """A user's backward hook on ``hook_resid_mid`` (computed beside the model) fires once in
    ``loss.backward()`` with the cached gradient; returning an edited gradient there is
    refused (it would reach no earlier layer), while on a name on the model's path
    (``hook_resid_pre``) the edit flows on to the layers before it."""
    bridge = Bridge(tiny_model("llama"))
    names = ["blocks.1.hook_resid_mid", "blocks.0.hook_resid_pre"]
    _, cache = bridge.run_with_cache(TOKENS, names_filter=names, return_type="loss", incl_bwd=True)
    seen: list[torch.Tensor] = []
    with bridge.hooks(bwd_hooks=[(names[0], lambda grad, hook: seen.append(grad.clone()))]):
        bridge(TOKENS, return_type="loss").backward()
    assert len(seen) == 1 and torch.equal(seen[0], cache[names[0] + "_grad"])
    with bridge.hooks(bwd_hooks=[(names[0], lambda grad, hook: 2 * grad)]):
        loss = bridge(TOKENS, return_type="loss")
        with pytest.raises(RuntimeError, match=r"'blocks\.1\.hook_resid_mid' returned a new gr"):
            loss.backward()
    reached: list[torch.Tensor] = []
    with bridge.hooks(
        bwd_hooks=[
            ("blocks.1.hook_resid_pre", lambda grad, hook: 2 * grad),
            (names[1], lambda grad, hook: reached.append(grad.clone())),
        ]
    ):
        bridge(TOKENS, return_type="loss").backward()
    assert not torch.allclose(reached[0], cache[names[1] + "_grad"])
    bridge.zero_grad()
