"""On a CUDA device: compiled quantized models (inductor, CUDA graphs, transformers' static-cache
generation) run qlens' kernels through the ``qlens::`` ops and agree with eager."""

from __future__ import annotations

import pytest
import torch
from kernel_route import count_fused_moe_decodes
from tiny_models import input_ids, make_model

from qlens.modules.model_quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCHEMES = ["int4", "mxfp4", "nvfp4", "fp8-block"]


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_inductor_and_cuda_graphs_match_eager(family: str, scheme: str, mode: str) -> None:
    torch._dynamo.reset()
    model = quantize(make_model(family), scheme).to("cuda", torch.bfloat16)
    ids = input_ids().cuda()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        for _ in range(3):  # CUDA graphs record on a later call, then replay
            got = compiled(ids).logits
    # Same kernels on the same inputs; inductor fuses the bf16 elementwise ops around them
    # (norms, rotary, softmax) in another rounding order: bf16 (8 bits) over two layers.
    assert _rel(got, eager) < 2e-2


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_compiled_moe_decode_step_runs_the_fused_decode(
    scheme: str, mode: str, monkeypatch
) -> None:
    """One token a sequence: each MoE block's routed experts are one ``qlens::moe_decode`` node,
    which launches the fused decode (recorded into the CUDA graph under reduce-overhead)."""
    torch._dynamo.reset()
    model = quantize(make_model("qwen3_moe"), scheme).to("cuda", torch.bfloat16)
    ids = input_ids(seq=1).cuda()
    calls = count_fused_moe_decodes(monkeypatch)
    with torch.no_grad():
        eager = model(ids).logits
        eager_calls = len(calls)
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        for _ in range(3):
            got = compiled(ids).logits
    assert eager_calls == len(model.model.layers)
    assert len(calls) > eager_calls
    # The same kernels; inductor's fused norms and rotary round bf16 in another order.
    assert _rel(got, eager) < 2e-2


@pytest.mark.parametrize("scheme", SCHEMES)
def test_static_cache_generation_compiles_and_matches_eager(scheme: str) -> None:
    torch._dynamo.reset()
    model = quantize(make_model("llama"), scheme).to("cuda", torch.bfloat16)
    ids = input_ids(batch=1).cuda()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    # Greedy tokens of a random tiny model: eager and compiled static-cache decode pick the same
    # argmax unless two logits tie within bf16 rounding; the first new token is from one prefill.
    assert static.shape == eager.shape
    assert torch.equal(static[:, : ids.shape[1] + 1], eager[:, : ids.shape[1] + 1])


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_compiled_w8a8_matches_eager_and_the_reference(family: str, mode: str) -> None:
    import qlens
    from qlens.kernels.reference import reference_w8a8_linear

    torch._dynamo.reset()
    model = quantize(make_model(family), "fp8-block").to("cuda", torch.bfloat16)
    qlens.set_w8a8(model)
    ids = input_ids().cuda()
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 7, layer.in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        # float32 products of the reference's own FP8 codes: the bf16 output rounding remains.
        expected = reference_w8a8_linear(x.double(), layer.payload)
        assert _rel(layer(x), expected) < 4e-3
        eager = model(ids).logits
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        for _ in range(3):
            got = compiled(ids).logits
    # W8A8 rounds every linear's input to FP8 (3 mantissa bits, steps of 2**-3 relative).
    # Where inductor's fused norms and rotary round a bf16 value differently (2**-8 relative),
    # about 2**-8 / 2**-3 = 1/32 of the codes move one FP8 step: sqrt(1/32) * 2**-3, about 2%
    # of each linear's output, for each of a layer's seven linears (sqrt(7) * 2% ~ 6%).
    assert _rel(got, eager) < 6e-2


@pytest.mark.parametrize("scheme", [None, *SCHEMES])
def test_static_decoder_replays_cuda_graphs_with_the_tokens_of_its_eager_step(
    scheme: str | None,
) -> None:
    """fp32 activations: inductor's fused norms and rotary round differently from eager by about
    1e-7 relative, far below the gaps between a random tiny model's top logits."""
    from torch._dynamo.utils import counters

    from qlens.static_decode import StaticDecoder

    torch._dynamo.reset()
    counters.clear()
    model = make_model("llama")
    model = (quantize(model, scheme) if scheme else model).to("cuda")
    ids = input_ids(batch=2).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    reference = StaticDecoder(model, 32, compile=False)
    eager = {
        cut: reference.generate(ids[:, cut:], 12, attention_mask=mask[:, cut:]) for cut in (0, 3)
    }
    decoder = StaticDecoder(model, 32)  # inductor, CUDA graphs
    # The first call records the step's graph (its prompt eager), the second compiles the
    # prompt's, the third runs it on a shorter prompt.
    for cut in (0, 0, 3):
        got = decoder.generate(ids[:, cut:], 12, attention_mask=mask[:, cut:])
        assert torch.equal(got, eager[cut]), cut
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 2  # the step's and the prompt's


def test_static_decoder_records_in_cuda_graphs_what_its_eager_step_records() -> None:
    from torch._dynamo.utils import counters

    from qlens.bridge import Bridge
    from qlens.static_decode import StaticDecoder

    torch._dynamo.reset()
    counters.clear()
    bridge = quantize(Bridge(make_model("llama")), "int4").to("cuda")
    ids = input_ids(batch=2).cuda()
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
    _, eager = StaticDecoder(bridge, 32, compile=False).generate_with_cache(
        ids, 8, names, stop_at_eos=False
    )
    decoder = StaticDecoder(bridge, 32)  # inductor, CUDA graphs
    for _ in range(2):
        _, recorded = decoder.generate_with_cache(ids, 8, names, stop_at_eos=False)
        for name in names:  # fp32: fused elementwise ops round about 1e-7 relative apart
            torch.testing.assert_close(recorded[name], eager[name], rtol=1e-4, atol=1e-5)
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_static_decoder_fuses_sibling_linears_in_its_cuda_graphs(scheme: str, monkeypatch) -> None:
    """One token: q/k/v and gate/up run as stacked GEMVs in the recorded graph (every scheme
    on the row as it is), with the tokens of the unfused step (fp32: the stacked tile sums
    each product in another order, ~1e-7 relative)."""
    from kernel_route import count_stacked_launches
    from torch._dynamo.utils import counters

    from qlens.static_decode import StaticDecoder

    stacked = count_stacked_launches(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    model = quantize(make_model("llama"), scheme).to("cuda")
    ids = input_ids(batch=1).cuda()
    alone = StaticDecoder(model, 32, fuse_siblings=False).generate(ids, 12)
    assert stacked == []
    torch._dynamo.reset()
    fused = StaticDecoder(model, 32)
    for _ in range(2):
        assert torch.equal(fused.generate(ids, 12), alone)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert stacked and set(stacked) <= {2, 3}
