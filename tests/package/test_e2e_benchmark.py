"""benchmarks/e2e_model.py end to end on tiny models (CPU reference path), and its table logic."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import _e2e_models as models
from benchmarks import e2e_model


def cells_of(markdown: str, scheme: str) -> dict[str, str]:
    """The table row of ``scheme`` under the first table in ``markdown``, by column name."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[1:]:
        values = [c.strip() for c in line.strip("|").split("|")]
        if values[0] == scheme:
            return dict(zip(columns, values, strict=True))
    raise AssertionError(f"no row {scheme} in:\n{markdown}")


def test_tiny_run_measures_every_cell(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "e2e.md"
    text = e2e_model.main(
        ["--tiny", "--sizes", "1b", "--schemes", "int4,bnb-nf4", "--compile-schemes", "bf16"]
        + ["--out", str(out)]
    )
    assert out.read_text() == text + "\n"
    assert "- command: `python " in text and "transformers " in text
    bf16, int4, nf4 = (cells_of(text, s) for s in ("bf16", "int4", "bnb-nf4"))
    for row in (bf16, int4, nf4):
        assert not any(v.startswith("error:") for v in row.values()), row
    # Every bridge measurement of bf16 and int4 is a number; bitsandbytes runs plain HF only.
    bridge_columns = ("prefill ms", "cache resid_post ms", "decode tok/s", "steered tok/s")
    for column in (*bridge_columns, "HF prefill ms", "HF decode tok/s"):
        assert float(bf16[column]) > 0 and float(int4[column]) > 0, column
    assert all(nf4[column] == "-" for column in bridge_columns)
    assert float(nf4["HF decode tok/s"]) > 0 and nf4["HF decode vs NF4"] == "1.00x"
    assert float(bf16["compiled tok/s"]) > 0 and bf16["compiled vs bf16"] == "1.00x"
    # bf16 against itself in pairs is 1.00x by definition; the others are measured pairs.
    assert bf16["HF decode vs bf16, paired"] == "1.00x"
    for row in (int4, nf4):
        for column in ("HF prefill vs bf16, paired", "HF decode vs bf16, paired"):
            assert row[column].endswith("x") and float(row[column][:-1]) > 0, (column, row)
    # The bridge against plain HF, caching against a plain prefill and a steered decode
    # against an unsteered one, each on the same model in pairs.
    own_pairs = (
        "bridge overhead decode, paired",
        "cache / prefill, paired",
        "steering cost, paired",
    )
    for row in (bf16, int4):
        for column in own_pairs:
            assert row[column].endswith("x") and float(row[column][:-1]) > 0, (column, row)
    assert all(nf4[column] == "" for column in own_pairs)  # no bridge for bitsandbytes rows
    assert int4["compiled tok/s"] == "-"  # not in --compile-schemes
    # int4 with group 128 stores 4.125 bits per weight against 16; embeddings and the
    # unembedding stay bf16, so the tiny model shrinks less than 16 / 4.125.
    assert bf16["memory vs bf16"] == "1.00x" and 1.2 < float(int4["memory vs bf16"][:-1]) < 3.9


def test_weight_gib_counts_parameters_and_buffers_once():
    model = models.build_model(models.shapes(True, None)["1b"], torch.device("cpu"))
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one storage
    expected = sum(
        t.numel() * t.element_size()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if name != "lm_head.weight"
    )
    assert models.weight_gib(model) * 2**30 == expected


def test_bnb_weight_gib_includes_quantization_states():
    bnb = pytest.importorskip("bitsandbytes")
    model = models.build_model(models.shapes(True, None)["1b"], torch.device("cpu"))
    nf4 = models.bnb_quantized(model, "bnb-nf4")
    layer = nf4.model.layers[0].mlp.down_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    linears = [m for m in nf4.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # every linear of both layers, not lm_head
    codes = sum(m.weight.numel() for m in linears)  # two 4-bit codes per byte
    states = sum(m.weight.quant_state.absmax.nbytes for m in linears)
    plain = sum(
        t.nbytes
        for name, t in [*nf4.named_parameters(), *nf4.named_buffers()]
        if not any(name.startswith(f"{n}.") for n, m in nf4.named_modules() if m in linears)
    )
    assert models.weight_gib(nf4) * 2**30 >= plain + codes + states
    assert models.weight_gib(nf4) < models.weight_gib(model)


def test_a_failed_measurement_fills_its_cell_and_the_run_goes_on():
    row = e2e_model.Row("int4")

    def broken() -> float:
        raise ValueError("no kernel | for this\nsecond line")

    row.measure("decode", broken)
    row.measure("prefill_s", lambda: 0.25)
    assert row.cells == {"decode": "error: ValueError: no kernel \\| for this", "prefill_s": 0.25}


def test_table_ratios_against_bf16_and_nf4():
    rows = [
        e2e_model.Row("bf16", {"weights_gib": 2.0, "prefill_s": 0.2, "decode": 50.0}),
        e2e_model.Row(
            "int4",
            {"weights_gib": 0.5, "prefill_s": 0.25, "cache_s": 0.3, "decode": 100.0}
            | {"hf_prefill_s": 0.2, "hf_decode": 125.0},
        ),
        e2e_model.Row("bnb-nf4", {"hf_prefill_s": 0.4, "hf_decode": 25.0, "decode": "error: X"}),
    ]
    text = "\n".join(e2e_model.table(rows))
    int4 = cells_of(text, "int4")
    assert int4["weights GiB"] == "0.5" and int4["memory vs bf16"] == "4.00x"
    assert int4["prefill ms"] == "250.0" and int4["prefill speed-up vs bf16"] == "0.80x"
    assert int4["cache / bf16 prefill"] == "1.50x" and int4["decode vs bf16"] == "2.00x"
    assert int4["bridge overhead prefill"] == "1.25x"  # 0.25 s through the bridge, 0.2 s plain
    assert int4["bridge overhead decode"] == "1.25x"  # 125 tok/s plain, 100 through the bridge
    assert int4["HF prefill vs NF4"] == "2.00x" and int4["HF decode vs NF4"] == "5.00x"
    nf4 = cells_of(text, "bnb-nf4")
    assert nf4["decode tok/s"] == "error: X" and nf4["decode vs bf16"] == ""
    assert nf4["compiled tok/s"] == "-" and math.isclose(float(nf4["HF decode tok/s"]), 25.0)


def test_paired_time_ratio_is_the_median_of_alternating_pairs(monkeypatch):
    # Each side's timed runs, in call order: the host slows down between pairs (the ratio of
    # the first two pairs stays 2) and one pair is an outlier.
    times = iter([4.0, 2.0, 8.0, 4.0, 40.0, 10.0])
    monkeypatch.setattr(e2e_model, "median_wall_s", lambda call, repeats, warmup: next(times))
    calls: list[str] = []
    ratio = e2e_model.paired_time_ratio(
        lambda: calls.append("top"), lambda: calls.append("bottom"), repeats=3
    )
    assert calls == ["top", "bottom"]  # the warm-up runs; the timed ones go through the stub
    assert ratio == 2.0  # pairs 2.0, 2.0 and 4.0: their median


def test_the_w8a8_row_is_block_fp8_with_fp8_activations():
    from qlens.modules import QuantLinear

    base = models.build_model(models.shapes(True, None)["1b"], torch.device("cpu"))
    model = e2e_model.maker(base, e2e_model.W8A8_SCHEME)()
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 14 and all(m.w8a8 for m in linears)
    assert {m.payload.format.name for m in linears} == {"fp8_block"}
    assert e2e_model.W8A8_SCHEME in e2e_model.available_schemes(None)


@pytest.mark.parametrize(
    ("scheme", "module"), [("bnb-nf4-qlens", "Linear4bit"), ("bnb-int8-qlens", "Linear8bitLt")]
)
def test_the_rerouted_bitsandbytes_rows_run_qlens_forward_on_bitsandbytes_modules(scheme, module):
    bnb = pytest.importorskip("bitsandbytes")
    from qlens.modules.reroute import rerouted_payloads

    base = models.build_model(models.shapes(True, None)["1b"], torch.device("cpu"))
    model = e2e_model.maker(base, scheme)()
    quantized = [m for m in model.modules() if isinstance(m, getattr(bnb.nn, module))]
    assert len(quantized) == 14
    assert all(rerouted_payloads(m) is not None for m in quantized)
    assert scheme in e2e_model.available_schemes(None)


def test_unknown_scheme_is_an_error_naming_the_choices():
    with pytest.raises(SystemExit, match=r"unknown --schemes \['int3'\]; choose from fp8-block"):
        e2e_model.available_schemes("int4,int3")


def test_full_size_models_need_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        e2e_model.parse_args(["--sizes", "8b"])
    assert "full-size models need a CUDA GPU; on a CPU pass --tiny." in capsys.readouterr().err


def test_bitsandbytes_peers_named_without_bitsandbytes_are_an_error(monkeypatch):
    monkeypatch.setattr(e2e_model, "bnb_importable", lambda: False)
    assert "bnb-nf4" not in e2e_model.available_schemes(None)
    with pytest.raises(
        SystemExit, match="names bitsandbytes peers, but `import bitsandbytes` fails"
    ):
        e2e_model.available_schemes("int4,bnb-nf4")


def test_tiny_moe_has_the_configured_experts():
    model = models.build_model(models.shapes(True, None)["moe"], torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * 64, 128)
    assert model.config.num_experts_per_tok == 2 and model.generation_config.eos_token_id is None


def test_a_shape_whose_model_cannot_be_built_reports_it(monkeypatch):
    def no_memory(shape, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(e2e_model, "build_model", no_memory)  # as measure_shape finds it
    args = e2e_model.parse_args(["--tiny", "--sizes", "1b"])
    rows = e2e_model.measure_shape(
        models.shapes(True, None)["1b"], ["int4"], args, torch.device("cpu")
    )
    assert [(r.scheme, r.cells) for r in rows] == [
        (
            "bf16",
            {
                "weights_gib": "error: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
            },
        )
    ]


def test_for_each_quantized_hands_over_one_quantized_model_at_a_time():
    """Each scheme's model is quantized from the base and let go before the next is built."""
    import weakref

    from qlens.modules import QuantLinear

    base = models.build_model(models.shapes(True, None)["1b"], torch.device("cpu"))
    seen: list[tuple[str, int]] = []
    alive: list[weakref.ref] = []

    def run(scheme: str, model: torch.nn.Module) -> None:
        assert all(ref() is None for ref in alive), "the previous model is still held"
        alive.append(weakref.ref(model))
        seen.append((scheme, sum(isinstance(m, QuantLinear) for m in model.modules())))

    e2e_model.for_each_quantized(base, ["int4", "nvfp4"], run)
    assert [s for s, _ in seen] == ["int4", "nvfp4"]
    assert all(count > 0 for _, count in seen), seen
    assert all(ref() is None for ref in alive)
    assert not any(isinstance(m, QuantLinear) for m in base.modules())  # the base is untouched
