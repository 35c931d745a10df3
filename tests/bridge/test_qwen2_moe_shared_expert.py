"""``mlp.hook_routed_out`` / ``mlp.hook_shared_expert_out`` of Qwen2-MoE blocks: HF's two terms
of the block's sum, captured bit-exactly, and edits that act as replacing them in HF does.

The oracle is HF's own modules under plain PyTorch hooks: the routed term is
``mlp.experts``' output, the shared term ``sigmoid(mlp.shared_expert_gate(x)) *
mlp.shared_expert(x)``. Replacing the shared term by ``P`` in HF is done with HF's own
arithmetic: the shared expert returns ``P`` and its gate ``+inf``, so the block adds
``sigmoid(inf) * P = P`` to the experts' output.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
import torch
from bridge_models import MOE_ARCHS, tiny_model
from hypothesis import given, settings
from module_hooks import recording, replacing

from qlens.bridge import Bridge

ROUTED, SHARED = "blocks.0.mlp.hook_routed_out", "blocks.0.mlp.hook_shared_expert_out"
MLP = "model.layers.0.mlp"
TERMS = [f"{MLP}.experts", f"{MLP}.shared_expert", f"{MLP}.shared_expert_gate", MLP]
# hook_attn_scores / hook_pattern switch attention to qlens' explicit path (other rounding)
SDPA_NAMES = lambda name: not name.endswith(("hook_attn_scores", "hook_pattern"))  # noqa: E731


def _tokens(batch: int = 2, pos: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, pos), generator=torch.Generator().manual_seed(seed))


TOKENS = _tokens()


def _hf_terms(hf: dict, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routed and gated shared terms of a recorded forward, as [batch pos d_model]."""
    shared = torch.sigmoid(hf[f"{MLP}.shared_expert_gate"]) * hf[f"{MLP}.shared_expert"]
    return hf[f"{MLP}.experts"].reshape(*shape, -1), shared.reshape(*shape, -1)


def _hf_logits(model: torch.nn.Module, tokens: torch.Tensor, edits: dict) -> torch.Tensor:
    with torch.no_grad(), replacing(model, edits):
        return model(tokens).logits


def _shared_replaced_by(patch: torch.Tensor) -> dict:
    """HF edits that make the block add ``patch`` ([batch pos d]) as its shared term."""
    flat = patch.reshape(-1, patch.shape[-1])
    return {
        f"{MLP}.shared_expert": lambda out: flat,
        f"{MLP}.shared_expert_gate": lambda out: torch.full_like(out, float("inf")),
    }


def test_names_exist_for_moe_layers_with_a_shared_expert_only() -> None:
    bridge = Bridge(tiny_model("qwen2_moe"))  # layer 0 MoE, layer 1 dense
    names = bridge.hook_names
    start = names.index("blocks.0.mlp.hook_router_weights")
    assert names[start + 1 : start + 4] == [ROUTED, SHARED, "blocks.0.hook_mlp_out"]
    assert {n for n in names if "routed" in n or "shared" in n} == {ROUTED, SHARED}
    assert bridge.blocks[0].mlp.hook_shared_expert_out is bridge.hook_dict[SHARED]
    with pytest.raises(KeyError, match="unknown hook name 'blocks.1.mlp.hook_shared_expert_out'"):
        bridge.run_with_hooks(TOKENS, fwd_hooks=[(SHARED.replace("0", "1"), lambda x, h: x)])


@pytest.mark.parametrize("arch", [a for a in MOE_ARCHS if a != "qwen2_moe"])
def test_moe_families_without_a_shared_expert_have_neither_name(arch: str) -> None:
    bridge = Bridge(tiny_model(arch))
    assert "blocks.0.mlp.hook_router_weights" in bridge.hook_names
    assert not [n for n in bridge.hook_names if "shared" in n or "routed" in n]
    for name in (ROUTED, SHARED):
        with pytest.raises(KeyError, match=f"unknown hook name {name!r} for this model"):
            bridge.run_with_cache(TOKENS, names_filter=[name])


@pytest.mark.parametrize("names", [[ROUTED], [SHARED], [ROUTED, SHARED], SDPA_NAMES])
def test_captured_terms_are_hf_values_and_logits_are_unchanged(names) -> None:  # noqa: ANN001
    model = copy.deepcopy(tiny_model("qwen2_moe"))
    bridge = Bridge(model)
    with torch.no_grad():
        with recording(model, TERMS) as hf:
            expected = model(TOKENS).logits
        logits, cache = bridge.run_with_cache(TOKENS, names_filter=names)
    assert torch.equal(logits, expected)
    routed, shared = _hf_terms(hf, TOKENS.shape)
    assert shared.abs().max() > 1e-3 and routed.abs().max() > 1e-3
    if ROUTED in cache:
        assert torch.equal(cache[ROUTED], routed)
        assert torch.equal(cache["routed_out", 0], routed)  # the cache's shorthand
    if SHARED in cache:
        assert torch.equal(cache[SHARED], shared)
        assert torch.equal(cache["shared_expert_out", 0], shared)
    if "blocks.0.hook_mlp_out" in cache:  # the block's output is the sum HF computes
        assert torch.equal(cache[ROUTED] + cache[SHARED], cache["blocks.0.hook_mlp_out"])
        assert torch.equal(cache["blocks.0.hook_mlp_out"], hf[MLP])


def test_zeroing_the_shared_expert_is_hf_without_its_output() -> None:
    model = tiny_model("qwen2_moe")
    bridge = Bridge(model)
    with torch.no_grad():
        ours = bridge.run_with_hooks(
            TOKENS, fwd_hooks=[(SHARED, lambda x, hook: torch.zeros_like(x))]
        )
    theirs = _hf_logits(model, TOKENS, {f"{MLP}.shared_expert": torch.zeros_like})
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, bridge(TOKENS))


def test_scaling_the_shared_term_is_scaling_hf_shared_expert_output() -> None:
    # sigmoid(g) * (4 s) == 4 (sigmoid(g) * s) exactly: a power of two only moves exponents
    model = tiny_model("qwen2_moe")
    with torch.no_grad():
        ours = Bridge(model).run_with_hooks(TOKENS, fwd_hooks=[(SHARED, lambda x, hook: 4 * x)])
    assert torch.equal(ours, _hf_logits(model, TOKENS, {f"{MLP}.shared_expert": lambda o: 4 * o}))


def test_patching_the_shared_term_from_another_prompt_acts_as_in_hf() -> None:
    model = tiny_model("qwen2_moe")
    bridge = Bridge(model)
    other = _tokens(seed=11)
    with torch.no_grad():
        _, source = bridge.run_with_cache(other, names_filter=SHARED)
        patch = source[SHARED]
        ours = bridge.run_with_hooks(TOKENS, fwd_hooks=[(SHARED, lambda x, hook: patch)])
    assert torch.equal(ours, _hf_logits(model, TOKENS, _shared_replaced_by(patch)))
    with torch.no_grad(), recording(model, TERMS) as hf:  # the oracle's own check
        model(other)
    assert torch.equal(patch, _hf_terms(hf, other.shape)[1])


def test_editing_the_routed_term_is_editing_hf_experts_output() -> None:
    model = tiny_model("qwen2_moe")
    bridge = Bridge(model)
    noise = torch.randn((*TOKENS.shape, 64), generator=torch.Generator().manual_seed(5))
    hooks = [(ROUTED, lambda x, hook: x + noise)]
    seen = [ROUTED, "blocks.0.hook_mlp_out"]
    with torch.no_grad():
        ours = bridge.run_with_hooks(TOKENS, fwd_hooks=hooks)
        with bridge.hooks(fwd_hooks=[*hooks, (SHARED, lambda x, hook: 0 * x)]):
            both, cache = bridge.run_with_cache(TOKENS, names_filter=seen)
    experts = {f"{MLP}.experts": lambda out: out + noise.reshape(out.shape)}
    assert torch.equal(ours, _hf_logits(model, TOKENS, experts))
    zero_shared = {**experts, f"{MLP}.shared_expert": torch.zeros_like}
    assert torch.equal(both, _hf_logits(model, TOKENS, zero_shared))
    # hook_mlp_out sees the block's output after both edits: the edited routed term plus zero
    assert torch.equal(cache["blocks.0.hook_mlp_out"], cache[ROUTED])


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 3), pos=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_shapes_follow_batch_and_positions(batch: int, pos: int, seed: int) -> None:
    model = tiny_model("qwen2_moe")
    tokens = _tokens(batch, pos, seed)
    patch = torch.randn((batch, pos, 64), generator=torch.Generator().manual_seed(seed))
    bridge = Bridge(model)
    with torch.no_grad():
        with recording(model, TERMS) as hf:
            model(tokens)
        _, cache = bridge.run_with_cache(tokens, names_filter=[ROUTED, SHARED])
        ours = bridge.run_with_hooks(tokens, fwd_hooks=[(SHARED, lambda x, h: patch)])
    routed, shared = _hf_terms(hf, tokens.shape)
    assert torch.equal(cache[ROUTED], routed) and torch.equal(cache[SHARED], shared)
    assert torch.equal(ours, _hf_logits(model, tokens, _shared_replaced_by(patch)))


def test_bfloat16_terms_and_logits_are_bit_identical_to_hf() -> None:
    model = copy.deepcopy(tiny_model("qwen2_moe")).to(torch.bfloat16)
    with torch.no_grad():
        with recording(model, TERMS) as hf:
            expected = model(TOKENS).logits
        logits, cache = Bridge(model).run_with_cache(TOKENS, names_filter=[ROUTED, SHARED])
    routed, shared = _hf_terms(hf, TOKENS.shape)
    assert cache[SHARED].dtype == torch.bfloat16 and torch.equal(cache[SHARED], shared)
    assert torch.equal(cache[ROUTED], routed) and torch.equal(logits, expected)


def test_gradients_flow_through_both_terms() -> None:
    model = copy.deepcopy(tiny_model("qwen2_moe"))
    bridge = Bridge(model)
    grads: dict[str, torch.Tensor] = {}

    def keep(grad: torch.Tensor, hook) -> None:  # noqa: ANN001
        grads[hook.name] = grad

    names = [ROUTED, SHARED, "blocks.0.hook_mlp_out"]
    with bridge.hooks(bwd_hooks=[(name, keep) for name in names]):
        bridge(TOKENS).logsumexp(-1).sum().backward()
    # d(routed + shared) / d(either term) is the identity
    assert grads[ROUTED].abs().sum() > 0
    assert torch.equal(grads[ROUTED], grads["blocks.0.hook_mlp_out"])
    assert torch.equal(grads[SHARED], grads["blocks.0.hook_mlp_out"])
    # a zero gradient at the shared term reaches none of the shared expert's weights
    model.zero_grad(set_to_none=True)
    zero = [(SHARED, lambda grad, hook: torch.zeros_like(grad))]
    with bridge.hooks(bwd_hooks=zero):
        bridge(TOKENS).logsumexp(-1).sum().backward()
    mlp = model.model.layers[0].mlp
    for weight in (mlp.shared_expert.down_proj.weight, mlp.shared_expert_gate.weight):
        assert weight.grad is not None and torch.all(weight.grad == 0)
    assert mlp.experts.down_proj.grad.abs().sum() > 0


def test_hooks_are_removed_when_a_hook_raises() -> None:
    model = tiny_model("qwen2_moe")
    bridge = Bridge(model)

    def fail(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        bridge.run_with_hooks(TOKENS, fwd_hooks=[(SHARED, fail)])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        ours = bridge.run_with_hooks(TOKENS, fwd_hooks=[(SHARED, lambda x, h: 4 * x)])
    assert torch.equal(ours, _hf_logits(model, TOKENS, {f"{MLP}.shared_expert": lambda o: 4 * o}))


def test_a_shared_expert_without_its_gate_is_refused() -> None:
    model = copy.deepcopy(tiny_model("qwen2_moe"))
    del model.model.layers[0].mlp.shared_expert_gate
    with pytest.raises(
        ValueError,
        match="layer 0 of this qwen2_moe model has a shared expert but no shared_expert_gate "
        "module at the adapter's paths",
    ):
        Bridge(model)


def test_generation_with_the_shared_term_edited_at_every_step() -> None:
    model = tiny_model("qwen2_moe")
    bridge = Bridge(model)
    shapes: list[tuple[int, ...]] = []

    def amplify(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
        shapes.append(tuple(x.shape))
        return 256 * x  # exact: a power of two (see the scaling test)

    prompt = TOKENS[:1]
    kwargs = dict(max_new_tokens=6, stop_at_eos=False, return_type="tokens")
    with bridge.hooks(fwd_hooks=[(SHARED, amplify)]):
        ours = bridge.generate(prompt, **kwargs)
    with replacing(model, {f"{MLP}.shared_expert": lambda out: 256 * out}):
        theirs = bridge.generate(prompt, **kwargs)  # no bridge hooks: HF's own generate
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, bridge.generate(prompt, **kwargs))
    # the prompt, then one new token per step through the KV cache
    assert shapes == [(1, 7, 64)] + [(1, 1, 64)] * 5
