"""Every weight-space accessor and analysis refuses each kind of unreadable weight, naming the
operation, the reason and the quantization method; with the opt-in it returns exactly the
dequantized values (``qlens.dequantize``, or a tensor subclass' own ``dequantize()``)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from arch_models import tiny_model
from unreadable_models import (
    DEQUANTIZABLE,
    EXPECTED,
    KINDS,
    PackedWrapper,
    float_model,
    swapped_bridge,
)

import qlens
from qlens import analysis
from qlens.bridge import Bridge
from qlens.weights import accessors as A
from qlens.weights import circuits, dequantized, processing, read_weight

_BRIDGES: dict[str, Bridge] = {}


def bridge_of(kind: str) -> Bridge:
    if kind not in _BRIDGES:
        _BRIDGES[kind] = swapped_bridge(kind)
    return _BRIDGES[kind]


@pytest.fixture(scope="module")
def float_cache():
    bridge = Bridge(float_model())
    _, cache = bridge.run_with_cache(torch.arange(1, 9)[None])
    return cache


# name -> (call(bridge, cache), the operation the error must name)
READS = {
    "W_Q": (lambda b, c: A.W_Q(b, 0), "read W_Q of layer 0"),
    "W_K": (lambda b, c: A.W_K(b, 0), "read W_K of layer 0"),
    "W_V": (lambda b, c: A.W_V(b, 0), "read W_V of layer 0"),
    "W_Q stacked": (lambda b, c: A.W_Q(b), "read W_Q of layer 0"),
    "W_V stacked": (lambda b, c: A.W_V(b, repeat_kv=True), "read W_V of layer 0"),
    "W_O": (lambda b, c: A.W_O(b, 0), "read W_O of layer 0"),
    "b_Q": (lambda b, c: A.b_Q(b, 0), "read W_Q of layer 0"),
    "b_K": (lambda b, c: A.b_K(b, 0), "read W_K of layer 0"),
    "b_V": (lambda b, c: A.b_V(b, 0, repeat_kv=True), "read W_V of layer 0"),
    "b_O": (lambda b, c: A.b_O(b, 0), "read b_O of layer 0"),
    "W_in": (lambda b, c: A.W_in(b, 0), "read W_in of layer 0"),
    "W_gate": (lambda b, c: A.W_gate(b, 0), "read W_gate of layer 0"),
    "W_out": (lambda b, c: A.W_out(b), "read W_out of layer 0"),
    "b_out": (lambda b, c: A.b_out(b, 0), "read W_out of layer 0"),
    "W_U": (lambda b, c: A.W_U(b), r"read W_U \(unembedding\)"),
    "b_U": (lambda b, c: A.b_U(b), r"read W_U \(unembedding\)"),
    "OV_circuit": (lambda b, c: circuits.OV_circuit(b, 0), "read W_V of layer 0"),
    "QK_circuit": (lambda b, c: circuits.QK_circuit(b), "read W_Q of layer 0"),
    "composition": (lambda b, c: circuits.all_composition_scores(b, "Q"), "read W_V of layer 0"),
    "process_weights": (lambda b, c: processing.process_weights(b), "process the model's weights"),
    "fold_layer_norm": (lambda b, c: processing.fold_layer_norm(b), "fold layer norms"),
    "center_unembed": (lambda b, c: processing.center_unembed(b), "center the unembedding"),
    "fold_value_biases": (lambda b, c: processing.fold_value_biases(b), "fold value biases"),
    "stack_head_results": (lambda b, c: analysis.stack_head_results(b, c), "read W_O of layer 0"),
    "full_decomposition": (
        lambda b, c: analysis.get_full_resid_decomposition(b, c),
        "read W_O of layer 0",
    ),
    "logit_attrs": (
        lambda b, c: analysis.logit_attrs(b, c["hook_embed"][None], 3),
        r"read W_U \(unembedding\)",
    ),
    "logit_lens": (lambda b, c: analysis.logit_lens(b, c), r"read W_U \(unembedding\)"),
}


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_refuses_unreadable_weights(kind, read, float_cache):
    call, operation = READS[read]
    reason, method = EXPECTED[kind]
    with pytest.raises(NotImplementedError) as error:
        call(bridge_of(kind), float_cache)
    message = str(error.value)
    assert re.search(f"qlens cannot {operation}", message), message
    assert re.search(reason, message), message
    if method is None:
        assert "(quantization:" not in message and "equantiz" not in message, message
    else:
        assert re.search(rf"\(quantization: {method}\)", message), message


def _oracle(module: torch.nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if type(weight).__module__.startswith("torchao"):
        return weight.dequantize()
    return qlens.dequantize(module)


@pytest.mark.parametrize("kind", DEQUANTIZABLE)
def test_opt_in_returns_the_dequantized_weights(kind):
    bridge = bridge_of(kind)
    attn = bridge.model.model.layers[0].self_attn
    mlp = bridge.model.model.layers[0].mlp
    n_heads, n_kv, d_model = bridge.cfg.n_heads, bridge.cfg.n_kv_heads, bridge.cfg.d_model
    q, k, o = _oracle(attn.q_proj), _oracle(attn.k_proj), _oracle(attn.o_proj)
    assert torch.equal(read_weight(attn.q_proj, operation="x", dequantize=True), q)
    assert torch.equal(A.W_Q(bridge, 0, dequantize=True), q.reshape(n_heads, -1, d_model).mT)
    w_k = k.reshape(n_kv, -1, d_model).mT
    assert torch.equal(A.W_K(bridge, 0, dequantize=True), w_k)
    assert torch.equal(
        A.W_K(bridge, 0, repeat_kv=True, dequantize=True),
        w_k.repeat_interleave(n_heads // n_kv, 0),
    )
    assert torch.equal(A.W_O(bridge, 0, dequantize=True), o.T.reshape(n_heads, -1, d_model))
    assert torch.equal(A.W_gate(bridge, 0, dequantize=True), _oracle(mlp.gate_proj).T)
    assert torch.equal(A.W_in(bridge, 0, dequantize=True), _oracle(mlp.up_proj).T)
    assert torch.equal(A.W_out(bridge, 0, dequantize=True), _oracle(mlp.down_proj).T)
    assert torch.equal(A.W_U(bridge, dequantize=True), _oracle(bridge.model.lm_head).T)
    w_v = _oracle(attn.v_proj).reshape(n_kv, -1, d_model).mT
    assert torch.equal(A.W_V(bridge, 0, dequantize=True), w_v)
    assert torch.equal(A.W_V(bridge, dequantize=True), w_v[None])
    w_v_per_query_head = w_v.repeat_interleave(n_heads // n_kv, 0)
    w_o = o.T.reshape(n_heads, -1, d_model)
    with dequantized(bridge):
        assert torch.equal(circuits.OV_circuit(bridge, 0).AB, w_v_per_query_head @ w_o)


@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_opt_in_analyses_use_the_dequantized_weights(kind, float_cache):
    """With the opt-in, the per-head results and the logit lens are computed from exactly the
    oracle-dequantized W_O and W_U."""
    bridge = bridge_of(kind)
    n_heads, d_model = bridge.cfg.n_heads, bridge.cfg.d_model
    w_o = _oracle(bridge.model.model.layers[0].self_attn.o_proj).T.reshape(n_heads, -1, d_model)
    z = float_cache["blocks.0.attn.hook_z"]
    expected = torch.einsum("bphd,hdm->hbpm", z, w_o)
    results = analysis.stack_head_results(bridge, float_cache, dequantize=True)
    assert results.labels["component"] == [f"L0H{h}" for h in range(n_heads)]
    torch.testing.assert_close(results.values, expected, rtol=1e-6, atol=1e-6)

    w_u = _oracle(bridge.model.lm_head).T
    resid = float_cache.accumulated_resid(apply_ln=True)[..., -1, :]
    probs = (resid @ w_u).softmax(-1)
    lens = analysis.logit_lens(bridge, float_cache, k=3, dequantize=True)
    torch.testing.assert_close(lens.probs, probs.topk(3, dim=-1).values, rtol=1e-5, atol=1e-6)
    assert torch.equal(lens.token_ids, probs.topk(3, dim=-1).indices)


@pytest.mark.parametrize("kind", ["non_tensor", "meta"])
def test_opt_in_still_refuses_what_cannot_be_rebuilt(kind):
    expected = "no dequantizer for a" if kind == "non_tensor" else "so there are no values to read"
    with pytest.raises(NotImplementedError, match=expected):
        A.W_O(bridge_of(kind), 0, dequantize=True)


def test_dequantized_context_is_per_bridge_and_scoped():
    bridge, other = bridge_of("float8"), bridge_of("qlens_payload")
    expected = A.W_O(bridge, 0, dequantize=True)
    with dequantized(bridge) as opted:
        assert opted is bridge
        assert torch.equal(A.W_O(bridge, 0), expected)
        assert isinstance(circuits.OV_circuit(bridge, 0).AB, torch.Tensor)
        with pytest.raises(NotImplementedError, match="read W_O of layer 0"):
            A.W_O(other, 0)
    with pytest.raises(NotImplementedError, match="read W_O of layer 0"):
        A.W_O(bridge, 0)
    with bridge.dequantized():  # the same opt-in as a method of the bridge
        assert torch.equal(A.W_O(bridge, 0), expected)
    with pytest.raises(NotImplementedError, match="read W_O of layer 0"):
        A.W_O(bridge, 0)
    with dequantized():
        assert torch.equal(A.W_O(other, 0), qlens.dequantize(
            other.model.model.layers[0].self_attn.o_proj
        ).T.reshape(other.cfg.n_heads, -1, other.cfg.d_model))  # fmt: skip


def _raw_storage(kind: str, rows: int, cols: int) -> object:
    """An embedding table of ``rows x cols`` stored as ``kind`` (no scales: not rebuildable)."""
    return {
        "int8": lambda: torch.zeros(rows, cols, dtype=torch.int8),
        "packed_uint8": lambda: torch.zeros(rows * cols // 2, 1, dtype=torch.uint8),
        "int32": lambda: torch.zeros(rows, cols // 8, dtype=torch.int32),
        "float8": lambda: torch.zeros(rows, cols, dtype=torch.float8_e4m3fn),
        "non_tensor": PackedWrapper,
        "meta": lambda: torch.empty(rows, cols, device="meta"),
    }[kind]()


def _store(module: torch.nn.Module, stored: object) -> None:
    del module.weight
    if isinstance(stored, torch.Tensor):
        stored = torch.nn.Parameter(stored, requires_grad=False)
    module.weight = stored


RAW_KINDS = ["int8", "packed_uint8", "int32", "float8", "non_tensor", "meta"]


@pytest.mark.parametrize("kind", RAW_KINDS)
def test_embedding_reads_are_guarded(kind):
    bridge = Bridge(float_model())
    _store(bridge.embed, _raw_storage(kind, 64, 128))
    reason = EXPECTED[kind][0]
    with pytest.raises(NotImplementedError, match=r"qlens cannot read W_E \(token embedding\)"):
        A.W_E(bridge)
    with pytest.raises(NotImplementedError, match=reason):
        A.W_E(bridge)
    with pytest.raises(NotImplementedError, match="W_E"):
        A.W_E(bridge, dequantize=True)  # a bare tensor carries no scales to rebuild it from


@pytest.mark.parametrize("kind", RAW_KINDS)
def test_position_embedding_reads_are_guarded(kind):
    bridge = Bridge(copy.deepcopy(tiny_model("gpt2")))
    n_ctx, d_model = bridge.pos_embed.weight.shape
    _store(bridge.pos_embed, _raw_storage(kind, n_ctx, d_model))
    operation = r"qlens cannot read W_pos \(position embedding\)"
    with pytest.raises(NotImplementedError, match=operation):
        A.W_pos(bridge)
    with pytest.raises(NotImplementedError, match=EXPECTED[kind][0]):
        A.W_pos(bridge)
    with pytest.raises(NotImplementedError, match="W_pos"):
        A.W_pos(bridge, dequantize=True)
