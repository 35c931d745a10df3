"""Compiled graphs run the one-row linears that read the same row as one op
(``qlens.kernels.sibling_fusion``): the same logits as eager, one ``qlens::sibling_linear`` per
q/k/v and gate/up group, and no fusion where it could change what a linear reads."""

from __future__ import annotations

import pytest
import torch
from kernel_route import count_stacked_launches
from tiny_models import input_ids, make_model
from torch import fx, nn

import qlens.kernels.plan as plan
from qlens import StaticDecoder, fusing_backend
from qlens.kernels import ops
from qlens.kernels.runtime import interpreting
from qlens.kernels.sibling_fusion import fuse_sibling_linears
from qlens.modules import QuantLinear
from qlens.modules.model_quantize import quantize
from qlens.quant.payload_spec import PayloadSpec, joined_keys, split_keys
from qlens.quant.quantize import quantize_weight

SIBLING_OP = "qlens.sibling_linear.default"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _captured(module: nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, int, torch.Tensor]:
    """``module`` compiled in one graph that the pass rewrites: the graph, the nodes replaced
    and the compiled output."""
    seen: list[tuple[fx.GraphModule, int]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):  # noqa: ANN202
        seen.append((gm, fuse_sibling_linears(gm)))
        return gm.forward

    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(*args)
    ((gm, replaced),) = seen
    return gm, replaced, out


def _targets(gm: fx.GraphModule) -> list[str]:
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [str(n.target) for n in calls if "qlens" in str(n.target)]


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "fp8-block"])
def test_one_token_fuses_qkv_and_gate_up_of_every_layer_and_keeps_the_logits(scheme) -> None:
    model = quantize(make_model("llama"), scheme)
    token = input_ids()[:1, :1]
    gm, replaced, out = _captured(model, token)
    assert replaced == 10  # 2 layers x (q, k, v + gate, up)
    # Per layer: one op for q/k/v, one for gate/up; o and down stay alone (2 layers).
    assert sorted(_targets(gm)) == ["qlens.linear"] * 4 + [SIBLING_OP] * 4
    with torch.no_grad():
        assert torch.equal(out.logits, model(token).logits)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_fusing_backend_gives_the_eager_logits(backend: str) -> None:
    model = quantize(make_model("qwen3"), "int4")
    token, tokens = input_ids()[:1, :1], input_ids()[:1]
    compiled = torch.compile(model, backend=fusing_backend(backend), fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(token).logits, model(token).logits)
        assert torch.equal(compiled(tokens).logits, model(tokens).logits)


def test_several_rows_are_not_fused() -> None:
    model = quantize(make_model("llama"), "int4")
    gm, replaced, _ = _captured(model, input_ids()[:1])
    assert replaced == 0 and SIBLING_OP not in _targets(gm)
    gm, replaced, _ = _captured(model, input_ids()[:, :1])  # two sequences, one token each
    assert replaced == 0


class _Pair(nn.Module):
    """Two linears on the same row, with an optional in-place edit of the row between them."""

    def __init__(self, first: QuantLinear, second: QuantLinear, edit: bool = False) -> None:
        super().__init__()
        self.first, self.second, self.edit = first, second, edit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        a = self.first(x)
        if self.edit:
            x.add_(1.0)
        return torch.cat([a, self.second(x)], dim=-1)


def _linear(out: int, k: int, scheme: str = "int4", bias: bool = False) -> QuantLinear:
    return QuantLinear(
        quantize_weight(torch.randn(out, k), scheme), torch.randn(out) if bias else None
    )


def test_a_row_edited_in_place_between_siblings_is_not_fused() -> None:
    pair = _Pair(_linear(32, 128), _linear(48, 128), edit=True)
    x = torch.randn(1, 128)
    gm, replaced, out = _captured(pair, x)
    assert replaced == 0
    with torch.no_grad():
        assert torch.equal(out, pair(x))
    gm, replaced, out = _captured(_Pair(pair.first, pair.second), x)
    assert replaced == 2 and _targets(gm) == [SIBLING_OP]


class _AlikeRows(nn.Module):
    """Two linears, each on its own row computed alike from ``x``, with an optional in-place
    edit of ``x`` between the two computations."""

    def __init__(self, first: QuantLinear, second: QuantLinear, edit: bool) -> None:
        super().__init__()
        self.first, self.second, self.edit = first, second, edit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        row = x * 2.0
        if self.edit:
            x.add_(1.0)
        return torch.cat([self.first(row), self.second(x * 2.0)], dim=-1)


@pytest.mark.parametrize("edit", [False, True])
def test_rows_computed_alike_fuse_unless_written_between(edit: bool) -> None:
    module = _AlikeRows(_linear(32, 128), _linear(48, 128), edit)
    x = torch.randn(1, 128)
    gm, replaced, out = _captured(module, x)
    assert replaced == (0 if edit else 2)
    with torch.no_grad():
        assert torch.equal(out, module(x))


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (lambda: _linear(48, 128, "nvfp4"), "another format"),
        (lambda: _linear(48, 128, bias=True), "a bias where the first has none"),
    ],
)
def test_linears_of_another_format_or_bias_are_not_fused(second, why) -> None:
    pair = _Pair(_linear(32, 128), second())
    x = torch.randn(1, 128)
    gm, replaced, out = _captured(pair, x)
    assert replaced == 0, why
    with torch.no_grad():
        assert torch.equal(out, pair(x))


def test_biases_are_added_to_each_siblings_columns() -> None:
    pair = _Pair(_linear(32, 128, bias=True), _linear(48, 128, bias=True))
    x = torch.randn(1, 128)
    gm, replaced, out = _captured(pair, x)
    assert replaced == 2
    with torch.no_grad():
        assert torch.equal(out, pair(x))


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "fp8-block"])
def test_the_joined_keys_print_without_escapes_and_split_back(scheme) -> None:
    """Inductor writes the op's string into generated code, partly inside other string
    literals: a backslash there (an escaped newline) broke the module's import on GPUs."""
    model = quantize(make_model("llama"), scheme)
    gm, _, _ = _captured(model, input_ids()[:1, :1])
    joined = [n.args[2] for n in gm.graph.nodes if str(n.target) == SIBLING_OP]
    assert all(repr(text) == f"'{text}'" for text in joined)
    # Per layer q/k/v then gate/up, each sibling's own key in order.
    sibling_keys = [
        PayloadSpec.of(getattr(block, part).payload).key
        for layer in model.model.layers
        for block, names in ((layer.self_attn, "qkv"), (layer.mlp, ("gate", "up")))
        for part in (f"{n}_proj" for n in names)
    ]
    assert [key for text in joined for key in split_keys(text)] == sibling_keys
    assert all(joined_keys(split_keys(text)) == text for text in joined)


def test_keys_with_a_backslash_are_refused() -> None:
    key = PayloadSpec.of(quantize_weight(torch.randn(32, 128), "int4")).key
    with pytest.raises(ValueError, match="backslash"):
        joined_keys([key, key.replace("INT4", "INT4\\n")])


def test_the_sibling_op_passes_opcheck() -> None:
    payloads = [quantize_weight(torch.randn(n, 128), "int4") for n in (32, 48, 16)]
    tensors = [t for p in payloads for t in p.tensors().values()]
    specs = joined_keys([PayloadSpec.of(p).key for p in payloads])
    for x, biases in (
        (torch.randn(1, 128), [None, None, None]),
        (torch.randn(1, 1, 128), [torch.randn(32), torch.randn(48), torch.randn(16)]),
    ):
        torch.library.opcheck(ops.sibling_linear_op, (x, tensors, specs, biases))


@pytest.mark.skipif(
    not interpreting(), reason="runs the kernels on CPU tensors (TRITON_INTERPRET=1)"
)
@pytest.mark.parametrize("scheme", ["int4", "fp8-block", "nvfp4"])
def test_the_fused_op_launches_once_per_group_on_the_kernel_route(scheme, monkeypatch) -> None:
    """The compiled step's sibling ops run one stacked GEMV each (Triton's interpreter), with
    the logits of the unfused graph. Block FP8's k and v (64 rows) end inside a 128-row scale
    block: that group runs its linears one by one."""
    monkeypatch.setattr(plan, "choose_route", lambda payload, device: ("kernel", None))
    stacked = count_stacked_launches(monkeypatch)
    model = quantize(make_model("llama").to(torch.bfloat16), scheme)
    token = input_ids()[:1, :1]
    with torch.no_grad():
        fused = torch.compile(model, backend=fusing_backend("eager"), fullgraph=True)(token)
        assert stacked == ([2] if scheme == "fp8-block" else [3, 2]) * 2
        torch._dynamo.reset()
        alone = torch.compile(model, backend="eager", fullgraph=True)(token)
    # The stacked launch sums each product in the order of its own tile.
    torch.testing.assert_close(fused.logits, alone.logits, rtol=2e-2, atol=2e-2)


def _count_fusions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by the nodes replaced each time the pass runs."""
    from qlens.kernels import sibling_fusion

    replaced: list[int] = []
    fuse = sibling_fusion.fuse_sibling_linears

    def counted(gm: fx.GraphModule) -> int:
        replaced.append(fuse(gm))
        return replaced[-1]

    monkeypatch.setattr(sibling_fusion, "fuse_sibling_linears", counted)
    return replaced


def test_the_static_decoder_fuses_unless_told_not_to(monkeypatch) -> None:
    replaced = _count_fusions(monkeypatch)
    model = quantize(make_model("llama"), "int4")
    ids = input_ids()[:1, :4]
    fused = StaticDecoder(model, 16, backend="eager").generate(ids, 4)
    assert replaced == [10]
    torch._dynamo.reset()
    decoder = StaticDecoder(model, 16, backend="eager", fuse_siblings=False)
    assert torch.equal(decoder.generate(ids, 4), fused)
    assert replaced == [10] and "siblings unfused" in repr(decoder)
    with pytest.raises(ValueError, match="pass compile=True"):
        StaticDecoder(model, 16, compile=False, fuse_siblings=False)


def test_transformers_static_cache_generation_takes_the_fusing_backend(monkeypatch) -> None:
    from transformers import CompileConfig

    replaced = _count_fusions(monkeypatch)
    model = quantize(make_model("llama"), "int4")
    ids = input_ids()[:1, :4]
    config = CompileConfig(backend=fusing_backend("eager"), mode="default", fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on accelerators only otherwise
    kwargs = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        compiled = model.generate(ids, compile_config=config, **kwargs)
        assert replaced and set(replaced) == {10}
        assert torch.equal(compiled, model.generate(ids, **kwargs | {"cache_implementation": None}))


def test_mode_and_options_belong_to_inductor() -> None:
    model = quantize(make_model("llama"), "int4")
    compiled = torch.compile(model, backend=fusing_backend("eager"), mode="reduce-overhead")
    with torch.no_grad(), pytest.raises(Exception, match="mode and options are inductor's"):
        compiled(input_ids()[:1, :1])
    assert fusing_backend() == fusing_backend("inductor", None)  # equal configs compile once


def test_rerouted_fp8_projections_compile_whole_before_any_call_and_fuse() -> None:
    """transformers' FP8Linear q/k/v, rerouted: read when rerouted, so a whole-graph compile
    before any eager call traces no value check, and the three share one op."""
    from test_qmodel_reroute import _fp8_linear

    from qlens.modules.reroute import reroute_quantized_modules

    model = make_model("llama")
    for i, layer in enumerate(model.model.layers):
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            fp8 = _fp8_linear(getattr(layer.self_attn, name), seed=10 * i + j)
            setattr(layer.self_attn, name, fp8)
    assert len(reroute_quantized_modules(model, force=True)) == 6
    token = input_ids()[:1, :1]
    gm, replaced, out = _captured(model, token)
    assert replaced == 6 and _targets(gm) == [SIBLING_OP] * 2
    with torch.no_grad():
        assert torch.equal(out.logits, model(token).logits)
