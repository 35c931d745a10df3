"""q/k/v and gate/up QuantLinears share one launch at one row (``qlens.modules.siblings``):
the same logits and hooks as separate launches, and a module runs on its own whenever its
input is another tensor, was edited since, or the call is not one eager row. The kernels run
in Triton's interpreter, on the kernel route."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from kernel_route import count_stacked_launches
from tiny_models import input_ids, make_model

import qlens.kernels.plan as plan
from qlens.bridge import Bridge
from qlens.kernels.runtime import interpreting
from qlens.modules import QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.siblings import SiblingGroup, group_siblings, ungroup_siblings

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="runs the kernels on CPU tensors (TRITON_INTERPRET=1)"
)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel route for every payload, and a list that grows by one per shared launch."""
    monkeypatch.setattr(plan, "choose_route", lambda payload, device: ("kernel", None))
    return count_stacked_launches(monkeypatch)


def _quantized(scheme: str = "int4", family: str = "llama") -> torch.nn.Module:
    return quantize(make_model(family).to(torch.bfloat16), scheme)


def _attention(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_submodule("model.layers.0.self_attn")


def test_quantize_groups_qkv_and_gate_up_of_every_layer() -> None:
    model = _quantized()
    groups = {m._sibling_group for m in model.modules() if isinstance(m, QuantLinear)} - {None}
    assert sorted(len(g.members) for g in groups) == [2, 2, 3, 3]  # 2 layers
    attn = _attention(model)
    assert attn.q_proj._sibling_group.members == (attn.q_proj, attn.k_proj, attn.v_proj)
    assert [attn.k_proj._sibling_index, attn.v_proj._sibling_index] == [1, 2]
    assert model.get_submodule("model.layers.0.self_attn.o_proj")._sibling_group is None
    assert ungroup_siblings(model) == 10
    assert all(m._sibling_group is None for m in model.modules() if isinstance(m, QuantLinear))


# Siblings sharing a launch per layer. Block FP8's k and v (64 rows) end inside a 128-row
# scale block, so only gate and up share one.
GROUPS = {"int4": [3, 2], "nvfp4": [3, 2], "fp8-block": [2]}


@pytest.mark.parametrize("scheme", list(GROUPS))
def test_greedy_decode_is_unchanged_with_one_launch_per_group(scheme, launches) -> None:
    model = _quantized(scheme)
    ids = input_ids(seq=5, batch=1)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_logits=True)
    with torch.no_grad():
        shared = model.generate(ids, return_dict_in_generate=True, **kwargs)
        assert launches == GROUPS[scheme] * 2 * 2  # 2 decode steps, 2 layers
        ungroup_siblings(model)
        alone = model.generate(ids, return_dict_in_generate=True, **kwargs)
    assert len(launches) == len(GROUPS[scheme]) * 4
    assert torch.equal(shared.sequences, alone.sequences)
    for a, b in zip(shared.logits, alone.logits, strict=True):
        assert torch.equal(a, b)


def _qkv(attn: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]


def _alone(attn: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    group = attn.q_proj._sibling_group
    ungroup_siblings(attn)
    try:
        return _qkv(attn, x)
    finally:
        SiblingGroup(group.members)


def test_an_input_edited_between_siblings_is_read_as_edited(launches) -> None:
    attn = _attention(_quantized())
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        q = attn.q_proj(x)
        x.mul_(2)  # what a pre-hook on k_proj editing its input in place does
        k, v = attn.k_proj(x), attn.v_proj(x)
        expected = _alone(attn, x)
    assert launches == [3]
    assert not torch.equal(q, expected[0])  # q read x before the edit
    assert torch.equal(k, expected[1]) and torch.equal(v, expected[2])


def test_another_tensor_runs_the_sibling_on_its_own(launches) -> None:
    attn = _attention(_quantized())
    x, other = torch.randn(2, 1, 1, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        attn.q_proj(x)
        k = attn.k_proj(other)
        expected = _alone(attn, other)
    assert torch.equal(k, expected[1])


def test_what_does_not_share_a_launch(launches) -> None:
    attn = _attention(_quantized())
    rows = torch.randn(1, 3, 128, dtype=torch.bfloat16)
    one = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        _qkv(attn, rows)  # several rows: three launches
        with torch.inference_mode():
            _qkv(attn, one.clone())  # no version counter to prove k's input unchanged
    _qkv(attn, one.clone().requires_grad_())  # autograd
    attn.k_proj(one), attn.v_proj(one)  # no q_proj call: nothing kept for them
    assert launches == []
    with torch.no_grad():
        got = _qkv(attn, one)
        assert all(torch.equal(a, b) for a, b in zip(got, _alone(attn, one), strict=True))
    assert launches == [3]


def test_moved_or_reloaded_buffers_rebuild_the_shared_launch(launches) -> None:
    model = _quantized()
    attn = _attention(model)
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    group = attn.q_proj._sibling_group
    with torch.no_grad():
        before = _qkv(attn, x)
        model.load_state_dict(model.state_dict())
        assert group._kept is None  # the members' payloads were prepared again
        after = _qkv(attn, x)
        model.to(torch.float32)  # payload buffers keep their dtype, but are new tensors
        assert group._kept is None
        moved = _qkv(attn, x)
    assert launches == [3, 3, 3]
    assert all(torch.equal(a, b) for a, b in zip(before, moved, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_buffers_replaced_between_calls_stop_the_sharing(launches) -> None:
    attn = _attention(_quantized())
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    group = attn.q_proj._sibling_group
    with torch.no_grad():
        for _ in range(3):  # as an offloading hook does: new buffers for every forward
            _qkv(attn, x)
            for name in attn.k_proj._payload_buffers["weight"]:
                attn.k_proj._buffers[name] = attn.k_proj._buffers[name].clone()
        assert group._stopped
        got = _qkv(attn, x)
        assert launches == [3]
        assert all(torch.equal(a, b) for a, b in zip(got, _alone(attn, x), strict=True))


def test_w8a8_siblings_share_only_when_all_read_fp8_rows(launches) -> None:
    mlp = _quantized("fp8-block").get_submodule("model.layers.0.mlp")
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.gate_proj(x), mlp.up_proj(x)
        mlp.up_proj.w8a8 = True  # FP8 activations for one: the numerics differ
        mixed = [mlp.gate_proj(x), mlp.up_proj(x)]
        assert launches == [2]
        mlp.gate_proj.w8a8 = True
        shared = [mlp.gate_proj(x), mlp.up_proj(x)]
        assert launches == [2, 2]
        ungroup_siblings(mlp)
        alone = [mlp.gate_proj(x), mlp.up_proj(x)]
    assert torch.equal(mixed[1], alone[1])
    assert all(torch.equal(a, b) for a, b in zip(shared, alone, strict=True))


def test_bridge_hooks_fire_on_shared_outputs(launches) -> None:
    model = _quantized()
    bridge = Bridge(model)
    ids = input_ids(seq=1, batch=1)
    seen: dict[str, torch.Tensor] = {}

    def keep(tensor, hook):  # noqa: ANN001, ANN202
        seen[hook.name] = tensor.clone()

    def zero_v(tensor, hook):  # noqa: ANN001, ANN202
        return torch.zeros_like(tensor)

    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v"]
    with torch.no_grad():
        shared = bridge.run_with_hooks(
            ids, fwd_hooks=[*[(n, keep) for n in names], ("blocks.1.attn.hook_v", zero_v)]
        )
        assert len(launches) == 4
        ungroup_siblings(model)
        shared_seen = dict(seen)
        alone = bridge.run_with_hooks(
            ids, fwd_hooks=[*[(n, keep) for n in names], ("blocks.1.attn.hook_v", zero_v)]
        )
    assert len(launches) == 4
    assert torch.equal(shared, alone)
    assert all(torch.equal(shared_seen[n], seen[n]) for n in names)
    assert group_siblings(model)  # the Bridge groups the siblings of the model it wraps


def test_copies_do_not_share_launches_until_grouped_again(launches) -> None:
    model = _quantized()
    for copied in (
        copy.deepcopy(model),
        copy.deepcopy(_attention(model).q_proj),
        torch.load(_saved(model), weights_only=False),
    ):
        assert all(m._sibling_group is None for m in copied.modules() if isinstance(m, QuantLinear))
    assert _attention(model).q_proj._sibling_group is not None  # the original keeps its own
    assert len(group_siblings(copy.deepcopy(model))) == 4


def _saved(model: torch.nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer
