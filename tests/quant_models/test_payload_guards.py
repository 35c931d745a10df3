"""A compiled ``StaticDecoder`` step leaves the payload buffers' tensor guards out (dynamo checked
them at every step) and checks the same properties itself once a call: the signature it
compares follows dtype, shape and strides, a changed signature recompiles the step (faked: the
CPU has one device, and payload validation refuses the other changes), a payload changed in
value only is read as it is now, and the tokens stay those of transformers' greedy
``generate``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import input_ids, make_model

import qlens.static_decode as static_decode
from qlens.modules.linear import QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.modules.payload_guards import (
    payload_signature,
    payload_tensors,
    without_payload_tensor_guards,
)
from qlens.static_decode import StaticDecoder


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, do_sample=False, max_new_tokens=tokens, pad_token_id=0)


COMPILED: list[int] = []  # one entry a graph the counting backend compiled


@torch._dynamo.register_backend(name="qlens_counting_eager")
def _counting_eager(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    COMPILED.append(1)
    return gm.forward


def _compiled_frames() -> int:
    return len(COMPILED)


def test_payload_tensors_are_every_quantized_modules_buffers_in_order() -> None:
    model = quantize(make_model("llama"), "nvfp4")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    expected = [t for m in linears for t in m.payload_tensors("weight")]
    assert len(expected) == sum(len(m.payload_specs()["weight"].tensor_names) for m in linears)
    assert len(expected) >= 3 * len(linears)  # codes, block scales, global scale
    assert [id(t) for t in payload_tensors(model)] == [id(t) for t in expected]
    assert payload_tensors(make_model("llama")) == []


def test_the_filter_drops_only_the_tensor_guards_of_payload_buffers() -> None:
    model = quantize(make_model("llama"), "int4")
    payload = payload_tensors(model)[0]
    parameter = model.lm_head.weight
    entries = [
        SimpleNamespace(guard_type="TENSOR_MATCH", value=payload),
        SimpleNamespace(guard_type="TYPE_MATCH", value=payload),
        SimpleNamespace(guard_type="TENSOR_MATCH", value=parameter),
        SimpleNamespace(guard_type="TENSOR_MATCH", value=payload.clone()),
        SimpleNamespace(guard_type="EQUALS_MATCH", value=3),
    ]
    assert without_payload_tensor_guards(model)(entries) == [False, True, True, True, True]


def test_the_compiled_step_is_traced_without_the_payloads_tensor_guards(monkeypatch) -> None:
    """Dynamo hands the filter a tensor guard for every payload buffer, and only those go."""
    model = quantize(make_model("llama"), "int4")
    dropped: list[tuple[str, int]] = []

    def recording_filter(module: torch.nn.Module):
        keep = without_payload_tensor_guards(module)

        def filter_guards(entries):
            kept = keep(entries)
            dropped.extend(
                (e.guard_type, id(e.value)) for e, k in zip(entries, kept, strict=True) if not k
            )
            return kept

        return filter_guards

    monkeypatch.setattr(static_decode, "without_payload_tensor_guards", recording_filter)
    ids = input_ids(seq=5, batch=1)
    decoder = StaticDecoder(model, 16, backend="qlens_counting_eager")
    for _ in range(2):  # the step compiles in the first call, the prompt in the second
        got = decoder.generate(ids, 6, stop_at_eos=False)
        assert torch.equal(got, _hf_greedy(model, ids, 6))
    assert {kind for kind, _ in dropped} == {"TENSOR_MATCH"}
    payloads = sorted(id(t) for t in payload_tensors(model))
    assert sorted(i for _, i in dropped) == sorted(payloads * 2)  # each graph's, once


def test_a_payload_changed_in_value_is_read_as_it_is_now_without_recompiling() -> None:
    model = quantize(make_model("llama"), "int4")
    linear = next(m for m in model.modules() if isinstance(m, QuantLinear))
    decoder = StaticDecoder(model, 16, backend="qlens_counting_eager")
    ids = input_ids(seq=5, batch=1)
    for _ in range(2):  # the step compiles, then the prompt
        before = decoder.generate(ids, 6, stop_at_eos=False)
        assert torch.equal(before, _hf_greedy(model, ids, 6))
    compiled = _compiled_frames()
    signature = payload_signature(model)
    linear._buffers["weight_scales"] = linear._buffers["weight_scales"] * 64  # another tensor
    assert payload_signature(model) == signature
    after = decoder.generate(ids, 6, stop_at_eos=False)
    assert _compiled_frames() == compiled
    assert torch.equal(after, _hf_greedy(model, ids, 6))
    assert not torch.equal(after, before)


def test_the_signature_follows_what_tensor_guards_check() -> None:
    model = quantize(make_model("llama"), "int4")
    linear = next(m for m in model.modules() if isinstance(m, QuantLinear))
    signature = payload_signature(model)
    data = linear._buffers["weight_data"]
    for changed in (data.t().contiguous().t(), data.view(torch.int8), data[:, :32]):
        linear._buffers["weight_data"] = changed  # strides, dtype, shape
        assert payload_signature(model) != signature
    linear._buffers["weight_data"] = data.clone()
    assert payload_signature(model) == signature


def test_a_changed_signature_drops_the_compiled_step_and_prompt(monkeypatch) -> None:
    """As when a payload buffer moved to another device on its own (the CPU has one device)."""
    model = quantize(make_model("llama"), "int4")
    decoder = StaticDecoder(model, 16, backend="qlens_counting_eager")
    ids = input_ids(seq=5, batch=1)
    for _ in range(2):  # the step compiles, then the prompt
        decoder.generate(ids, 6, stop_at_eos=False)
    compiled = _compiled_frames()
    real = static_decode.payload_signature
    moved = ((torch.device("meta"), *real(model)[0][1:]), *real(model)[1:])
    monkeypatch.setattr(static_decode, "payload_signature", lambda module: moved)
    assert torch.equal(decoder.generate(ids, 6, stop_at_eos=False), _hf_greedy(model, ids, 6))
    assert _compiled_frames() == compiled + 2  # the step and the prompt, both dropped
    compiled = _compiled_frames()
    decoder.generate(ids, 6, stop_at_eos=False)
    assert _compiled_frames() == compiled


def test_mode_is_refused_for_backends_other_than_inductor() -> None:
    with pytest.raises(ValueError, match="mode is inductor's; the backend is 'eager'"):
        StaticDecoder(make_model("llama"), 12, backend="eager", mode="reduce-overhead")
