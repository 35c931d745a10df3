"""The `qlens report` command, end to end and in process."""

from __future__ import annotations

import json
import re

import pytest
import torch

import qlens
from qlens.analysis import quantization_drift
from qlens.cli import DEFAULT_SCHEMES, main
from qlens.report import build_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FP32_EPS = torch.finfo(torch.float32).eps


def kl_rounding_bound(max_abs_logit: float) -> float:
    """How far two fp32 computations of the same small KL may differ in absolute terms.

    The lens KL (final residual -> final norm -> unembedding -> softmax -> log) and the model's
    logit KL (log_softmax of the model's logits) round differently: each log-probability is off
    by a few ulps of the logits' magnitude, and the d_model-term dot products of the
    unembedding sum in an order that depends on the CPU's vector width (AVX2 vs AVX-512). KL
    weights those errors by probabilities summing to 1, so the difference is bounded by a small
    multiple of eps * max|logit|, whatever the KL's own size. A relative tolerance on a KL of
    ~3e-5 (3e-8 absolute, a quarter of one ulp of 1.0) is tighter than fp32 can promise.
    """
    return 16 * FP32_EPS * max(1.0, max_abs_logit)


def _check_audit(audit: dict) -> None:
    rows, totals = audit["rows"], audit["totals"]
    assert totals["bytes"] == sum(row["bytes"] for row in rows)
    assert totals["elements"] == sum(row["elements"] for row in rows)
    assert totals["weights"] == len(rows)
    assert totals["readable"] == sum(row["readable"] for row in rows)
    assert totals["compression_ratio"] == pytest.approx(totals["baseline_bytes"] / totals["bytes"])


def _check_files(out, report: dict) -> None:
    page = (out / "report.html").read_text()
    assert len(report["figures"]) == 4
    for name in report["figures"]:
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    assert page.count('<img src="data:image/png;base64,') == len(report["figures"])
    assert not re.search(r"https?://|<script|<link|src=\"(?!data:)", page)


@pytest.mark.slow
def test_default_report_of_the_default_model(tmp_path, capsys):
    assert main(["report", "--top-k", "5", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "1. ' Paris'" in printed
    assert "qlens report" in captured.err and "100%" in captured.err  # the progress bar ran
    report = json.loads((tmp_path / "report.json").read_text())
    _check_files(tmp_path, report)

    labels = ["reference", *DEFAULT_SCHEMES]
    assert [v["label"] for v in report["run"]["versions"]] == labels
    # the bridge prepends the tokenizer's BOS by default, as TransformerLens does
    assert report["run"]["tokens"] == ["<|im_start|>", "The", " capital", " of", " France", " is"]
    assert report["top_predictions"]["reference"][0]["token"] == " Paris"
    assert all(len(report["top_predictions"][label]) == 5 for label in labels)

    for label in labels:
        _check_audit(report["audit"][label])
    reference = report["audit"]["reference"]["totals"]
    assert reference["unreadable"] == 0 and reference["compression_ratio"] == 1.0
    mxfp4 = report["audit"]["mxfp4"]
    assert mxfp4["totals"]["compression_ratio"] > 2
    down = next(r for r in mxfp4["rows"] if r["name"] == "model.layers.7.mlp.down_proj.weight")
    assert (down["readable"], down["format"], down["bits_per_weight"]) == (False, "mxfp4", 4.25)

    kls = {}
    for scheme in DEFAULT_SCHEMES:
        drift = report["drift"][scheme]
        assert len(drift["resid_cosine"]) == len(drift["resid_rel_error"]) == 30
        assert all(-1 <= c <= 1 for c in drift["resid_cosine"])
        assert all(e >= 0 for e in drift["resid_rel_error"])
        assert drift["logit_kl"] >= 0
        assert len(drift["lens_kl"]) == 30 and all(kl >= 0 for kl in drift["lens_kl"])
        # the lens after the last layer reads the model's own output distribution (40 taken as
        # a generous bound on SmolLM2's |logit|)
        assert drift["lens_kl"][-1] == pytest.approx(
            drift["logit_kl"], rel=1e-3, abs=kl_rounding_bound(40.0)
        )
        kls[scheme] = drift["logit_kl"]
    assert kls["fp8-block"] < kls["mxfp4"]  # 8-bit drifts less than 4-bit

    heads = report["heads"]["variants"]
    for label in labels:
        for kind in ("induction", "previous_token"):
            scores = torch.tensor(heads[label][kind]["scores"])
            assert scores.shape == (30, 9) and 0 <= scores.min() and scores.max() <= 1
    assert heads["reference"]["induction"]["found"], "SmolLM2 has induction heads"
    assert len(report["residual_norms"]) == 30


def test_report_values_match_the_bridge(tiny_llama_dir, tmp_path, capsys):
    prompt = "w1 w2 w3 w4 w1 w2"
    args = ["report", str(tiny_llama_dir), "--prompt", prompt, "--top-k", "3", "--quant", "int4"]
    assert main([*args, "--no-progress", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "qlens report" not in captured.err  # --no-progress hides the progress bar
    report = json.loads((tmp_path / "report.json").read_text())
    _check_files(tmp_path, report)

    bridge = qlens.load(tiny_llama_dir)
    quantized = qlens.quantize(bridge, "int4")
    tokens = bridge.to_tokens(prompt)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens)
        quantized_logits = quantized(tokens)
    for label, result in (("reference", logits), ("int4", quantized_logits)):
        top = torch.topk(torch.softmax(result[0, -1], -1), 3)
        rows = report["top_predictions"][label]
        assert [row["token_id"] for row in rows] == top.indices.tolist()
        assert [row["probability"] for row in rows] == pytest.approx(top.values.tolist(), rel=1e-6)
    drift = quantization_drift(bridge, quantized, tokens).to_dict()
    lens_kl = report["drift"]["int4"].pop("lens_kl")
    assert report["drift"]["int4"] == drift
    max_abs_logit = max(logits.abs().max().item(), quantized_logits.abs().max().item())
    assert lens_kl[-1] == pytest.approx(
        drift["logit_kl"], rel=1e-3, abs=kl_rounding_bound(max_abs_logit)
    )
    for label in ("reference", "int4"):
        _check_audit(report["audit"][label])
    capture = report["capture"]
    assert capture["hook_points"] == len(bridge.hook_names)
    assert capture["cached_tensors"] == len(cache.keys())
    z = capture["kinds"]["blocks.*.attn.hook_z"]
    assert (z["count"], z["shape"]) == (2, [1, 6, 4, 8])
    expected_norms = [cache[f"blocks.{i}.hook_resid_post"][0, -1].norm().item() for i in range(2)]
    assert [row["norm_last_position"] for row in report["residual_norms"]] == pytest.approx(
        expected_norms, rel=1e-6
    )
    printed = captured.out
    assert "== Quantization audit (every weight) ==" in printed
    assert (
        f"wrote {tmp_path / 'report.json'}, {tmp_path / 'report.html'} and 4 PNG files" in printed
    )


def test_quant_none_reports_the_float_model_alone(tiny_llama_dir, tmp_path, capsys):
    assert main(["report", str(tiny_llama_dir), "--quant", "none", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["top_predictions"]) == ["reference"]
    assert report["drift"] == {
        "skipped": "no quantized version to compare (no quantization scheme was asked for)"
    }


def test_an_already_quantized_model_is_reported_with_its_own_quantization(tiny_llama_dir):
    bridge = qlens.quantize(qlens.load(tiny_llama_dir), "int8")
    report = build_report(bridge, "w1 w2 w3", top_k=2).to_json()
    (version,) = report["run"]["versions"]
    assert version["role"] == "checkpoint" and version["label"].startswith("checkpoint (int8")
    assert report["audit"][version["label"]]["totals"]["unreadable"] == 14
    assert list(report["top_predictions"]) == [version["label"]]
    assert "already quantized" in report["drift"]["skipped"]
    with pytest.raises(ValueError, match="already quantized .* cannot be quantized again"):
        build_report(bridge, "w1 w2 w3", schemes=["int4"])


@pytest.mark.parametrize(
    ("argument", "message"),
    [("/no/such/model", "does not exist"), (".", "has no config.json")],
)
def test_bad_model_exits_with_a_message(argument, message, capsys):
    assert main(["report", argument]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("qlens report: error: cannot load model:")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_unknown_scheme_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--quant", "mxfp4", "int3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown quantization scheme 'int3'; known schemes: fp8-block, mxfp8, mxfp4" in err


def test_none_with_schemes_is_refused(capsys):
    assert main(["report", "--quant", "none", "int4"]) == 2
    assert "--quant none cannot be combined" in capsys.readouterr().err


def test_unwritable_out_dir_fails_before_loading(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["report", "/no/such/model", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qlens report: error: cannot write to --out {blocker / 'sub'}: ")
    assert "cannot load model" not in err


def test_model_without_tokenizer_exits_with_a_message(tiny_llama_dir, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_llama_dir / name).unlink()
    assert main(["report", str(tiny_llama_dir)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_top_k_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--top-k", "0"])
    assert exit_info.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_help_describes_every_option_and_scheme(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("MODEL", "--quant", "--prompt", "--top-k", "--device", "--out", "--no-progress"):
        assert option in text
    for scheme in ("fp8-block", "mxfp8", "mxfp4", "nvfp4", "int4", "int8", "none"):
        assert scheme in text


def test_invalid_device_fails_before_loading(capsys):
    assert main(["report", "/no/such/model", "--device", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qlens report: error: invalid --device 'nonsense'")
    assert "cannot load model" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_fails_with_a_remedy(capsys):
    assert main(["report", "--device", "cuda:0"]) == 2
    assert "sees no cuda device; use --device cpu" in capsys.readouterr().err
