"""`qlens.load` on MoE GGUF files written by gguf-py (tiny random Qwen3-MoE / Qwen2-MoE): the
stacked experts stay GGUF blocks in ``QuantExperts`` that decode to exactly gguf-py's values, and
the model predicts like transformers' own (dequantizing) GGUF loader."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    gguf_py_values,
    make_gguf_llama,
    transformers_gguf_model,
    write_gguf_llama,
)
from gguf_moe_files import (  # noqa: E402
    N_LAYERS,
    assert_expert_reads_are_guarded,
    assert_experts_are_the_files_blocks,
    assert_holds_the_weights_of,
    assert_reloads_with_the_same_gguf_experts,
    make_gguf_moe,
    moe_block_outputs,
    moe_type_of,
    write_gguf_moe,
)
from model_fixtures import make_tiny_tokenizer  # noqa: E402
from module_hooks import recording, replacing  # noqa: E402

import qlens  # noqa: E402
from qlens.gguf_loading import load_gguf_packed  # noqa: E402
from qlens.modules import QuantExperts, QuantLinear  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402
from qlens.weights import W_gate, W_in, W_out, W_shared_expert_gate  # noqa: E402

# Qwen3-MoE: one type everywhere, or llama.cpp's Q4_K_M-like mix (gguf_moe_files.MIXED).
# Qwen2-MoE's experts are 1408 wide (its config default), not whole 256-weight K-quant blocks.
CASES = (
    ("qwen3moe", "Q8_0"),
    ("qwen3moe", "Q4_0"),
    ("qwen3moe", "mixed"),
    ("qwen2moe", "Q8_0"),
    ("qwen2moe", "Q4_0"),
)
TOKENS = torch.tensor([[3, 17, 42, 8, 63, 5, 29]])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("gguf_moe")
    models = {arch: make_gguf_moe(arch) for arch in {arch for arch, _ in CASES}}
    return {
        (arch, kind): write_gguf_moe(
            models[arch], folder / f"tiny-{arch}-{kind}.gguf", arch, moe_type_of(kind)
        )
        for arch, kind in CASES
    }


def _qlens_model(path: Path) -> torch.nn.Module:
    """What ``qlens.load`` wraps."""
    return load_gguf_packed(path, dtype=torch.float32, device=None)


def _file_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_experts_stay_gguf_blocks_that_decode_to_gguf_py_values(files, case):
    path = files[case]
    expected = gguf_py_values(gguf.GGUFReader(str(path)))
    types = _file_types(path)
    model = _qlens_model(path)
    assert not [n for n, p in model.named_parameters() if p.ndim == 3]  # no float experts
    for index, layer in enumerate(model.model.layers):
        assert_experts_are_the_files_blocks(layer.mlp.experts, index, types, expected)
    formats = sorted({f"gguf_{t.lower()}" for t in types.values() if t not in ("F32", "F16")})
    assert audit_weights(model).formats == formats
    experts_rows = [r for r in audit_weights(model).rows if ".mlp.experts." in r.name]
    assert len(experts_rows) == 2 * N_LAYERS and not any(r.readable for r in experts_rows)
    for row in experts_rows:  # each row's reason names its own packed codes
        experts = model.get_submodule(row.name.rpartition(".")[0])
        codes = experts.payload_for(row.name.rpartition(".")[2]).data
        assert f"torch.uint8 and shape {list(codes.shape)}" in row.reason, row


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_qlens_predicts_like_transformers_gguf_loader(files, case):
    arch, _ = case
    path = files[case]
    reference = transformers_gguf_model(path)
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    model = bridge.model
    packed = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            assert torch.equal(qlens.dequantize(module), reference.get_submodule(name).weight)
            packed += 1
        elif isinstance(module, QuantExperts):
            theirs = reference.get_submodule(name)
            for leaf, values in qlens.dequantize(module).items():
                assert torch.equal(values, getattr(theirs, leaf)), f"{name}.{leaf}"
            packed += 1
    # attention q/k/v/o, experts (and Qwen2-MoE's shared expert) per layer, and lm_head
    assert packed == N_LAYERS * (5 if arch == "qwen3moe" else 8) + 1
    floats = dict(reference.named_parameters())
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, floats[name]), name
    with torch.no_grad():
        theirs = reference(TOKENS).logits
        ours = bridge(TOKENS)
    # Identical float32 weights and float routers, so both pick the same experts; the paths
    # differ only in matmul summation order (qlens dequantizes each hit expert then matmuls on
    # the same token rows), a few ulps per dot product of <= 1408 terms, through two layers.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())


@pytest.fixture(scope="module")
def bridge(files):
    return qlens.load(files["qwen3moe", "Q4_0"], tokenizer=make_tiny_tokenizer())


def test_moe_hooks_see_what_transformers_computes(bridge, files):
    seen = moe_block_outputs(transformers_gguf_model(files["qwen3moe", "Q4_0"]), 1, TOKENS)
    seen["router"] = seen["router"][0]  # the logits
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS)
    # the router's float logits on the same residual; the experts' sum as in the logits test
    mlp_out, router = cache["blocks.1.hook_mlp_out"][0], cache["blocks.1.mlp.hook_router_logits"]
    torch.testing.assert_close(router.reshape(seen["router"].shape), seen["router"])
    scale = seen["mlp"].abs().max().item()
    torch.testing.assert_close(mlp_out, seen["mlp"][0], rtol=0, atol=1e-5 * scale)


def test_expert_weight_reads_are_guarded(bridge, files):
    reference = transformers_gguf_model(files["qwen3moe", "Q4_0"]).model.layers[0].mlp.experts
    assert_expert_reads_are_guarded(bridge, reference, "gguf_q4_0", expert=3)


def test_qwen2moe_shared_expert_reads_are_guarded_and_decode_like_transformers(files):
    path = files["qwen2moe", "Q8_0"]
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    reference = transformers_gguf_model(path).model.layers[0].mlp
    for read in (W_in, W_gate, W_out):
        with pytest.raises(NotImplementedError, match="of the shared expert of layer 0") as error:
            read(bridge, 0, expert="shared")
        assert "gguf_q8_0" in str(error.value)
        with pytest.raises(ValueError, match="layer 0 is a mixture-of-experts layer with a shared"):
            read(bridge, 0)
    with bridge.dequantized():
        shared = [read(bridge, 0, expert="shared") for read in (W_gate, W_in, W_out)]
        gate = W_shared_expert_gate(bridge, 0)
    theirs = reference.shared_expert
    assert torch.equal(shared[0], theirs.gate_proj.weight.T)
    assert torch.equal(shared[1], theirs.up_proj.weight.T)
    assert torch.equal(shared[2], theirs.down_proj.weight.T)
    assert torch.equal(gate, reference.shared_expert_gate.weight[0])


def test_qwen2moe_shared_expert_hooks_see_the_loaded_terms(files):
    """On a GGUF Qwen2-MoE: the routed / shared-expert hooks hold the packed modules' own terms
    exactly (transformers' dequantizing loader's within the matmul order, as in the logits test),
    and zeroing the shared term is the model with its shared expert's output zeroed."""
    path = files["qwen2moe", "Q8_0"]
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    reference = transformers_gguf_model(path)
    mlp = "model.layers.1.mlp"
    terms = [f"{mlp}.experts", f"{mlp}.shared_expert", f"{mlp}.shared_expert_gate"]
    routed, shared = "blocks.1.mlp.hook_routed_out", "blocks.1.mlp.hook_shared_expert_out"
    with torch.no_grad():
        with recording(bridge.model, terms) as own, recording(reference, terms) as theirs:
            expected = bridge.model(TOKENS).logits
            reference(TOKENS)
        logits, cache = bridge.run_with_cache(TOKENS, names_filter=[routed, shared])
        zeroed = bridge.run_with_hooks(TOKENS, fwd_hooks=[(shared, lambda x, hook: 0 * x)])
        with replacing(bridge.model, {f"{mlp}.shared_expert": torch.zeros_like}):
            expected_zeroed = bridge.model(TOKENS).logits
    assert torch.equal(logits, expected)
    assert torch.equal(zeroed, expected_zeroed) and not torch.equal(zeroed, logits)
    for hooks, tolerance in ((own, 0.0), (theirs, 1e-5)):
        gated = torch.sigmoid(hooks[f"{mlp}.shared_expert_gate"]) * hooks[f"{mlp}.shared_expert"]
        for name, term in ((shared, gated), (routed, hooks[f"{mlp}.experts"])):
            atol = tolerance * term.abs().max().item()
            torch.testing.assert_close(cache[name][0], term, rtol=0, atol=atol)


def test_dequantize_on_load_gives_transformers_float_experts(files):
    path = files["qwen3moe", "mixed"]
    floats = qlens.load(path, dequantize=True, tokenizer=make_tiny_tokenizer())
    assert not any(isinstance(m, (QuantExperts, QuantLinear)) for m in floats.model.modules())
    reference = dict(transformers_gguf_model(path).named_parameters())
    for name, tensor in floats.model.named_parameters():
        assert torch.equal(tensor, reference[name]), name


def test_bfloat16_load_rounds_like_transformers(files):
    path = files["qwen3moe", "mixed"]
    model = load_gguf_packed(path, dtype=torch.bfloat16, device=None)
    assert_holds_the_weights_of(model, transformers_gguf_model(path, torch.bfloat16))


def test_saved_model_reloads_with_the_same_gguf_experts(bridge, tmp_path):
    assert_reloads_with_the_same_gguf_experts(bridge, tmp_path, TOKENS)


@pytest.mark.parametrize(
    ("types", "logged"),
    [
        ({"gate": "TQ2_0", "up": "TQ2_0", "down": "TQ2_0"}, True),
        ({"gate": "Q8_0", "up": "Q4_0", "down": "Q8_0"}, True),
        ({"gate": "F16", "up": "F16", "down": "F32"}, False),  # float in the file: nothing lost
    ],
    ids=["no-qlens-codec", "gate-up-differ", "float"],
)
def test_experts_that_cannot_stay_packed_load_as_gguf_py_floats(tmp_path, caplog, types, logged):
    def type_of(name: str) -> str:
        kind = name.split(".")[-2]
        return types[kind[4:-5]] if kind.endswith("_exps") else "Q8_0"

    path = write_gguf_moe(make_gguf_moe("qwen3moe"), tmp_path / "tiny.gguf", "qwen3moe", type_of)
    with caplog.at_level(logging.WARNING, logger="qlens.gguf_experts"):
        model = _qlens_model(path)
    for index in range(N_LAYERS):
        for part, kind in types.items():
            line = f"blk.{index}.ffn_{part}_exps.weight {kind}"
            assert (line in caplog.text) == logged, line
    expected = gguf_py_values(gguf.GGUFReader(str(path)))
    reference = dict(transformers_gguf_model(path).named_parameters())
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert not isinstance(experts, QuantExperts)
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
        np.testing.assert_array_equal(gate.numpy(), expected[f"blk.{index}.ffn_gate_exps.weight"])
        np.testing.assert_array_equal(up.numpy(), expected[f"blk.{index}.ffn_up_exps.weight"])
        assert isinstance(layer.self_attn.q_proj, QuantLinear)  # the linears stay packed
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, reference[name]), name


# model kwargs, write kwargs, the error
BROKEN = {
    "fewer-experts": (
        {},
        {"experts_written": 3},
        r"blk\.0\.ffn_gate_exps\.weight has shape \[3, 768, 256\] .* expects \[4, 768, 256\] "
        r".*: the file does not match its own metadata",
    ),
    "mislabelled-width": (
        {"expert_width": 512, "declared_width": 768},
        {},
        r"ffn_gate_exps\.weight has shape \[4, 512, 256\] .* expects \[4, 768, 256\] .*: the file "
        r"does not match its own metadata",
    ),
    "no-down": (
        {},
        {"omit": ("blk.1.ffn_down_exps.weight",)},
        r"broken\.gguf lacks blk\.1\.ffn_down_exps\.weight",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_experts_that_do_not_match_the_config_raise_naming_the_tensor(tmp_path, case):
    model_kwargs, write_kwargs, error = BROKEN[case]
    declared = model_kwargs.pop("declared_width", None)
    model = make_gguf_moe("qwen3moe", **model_kwargs)
    if declared is not None:  # the metadata names another width than the tensors have
        model.config.moe_intermediate_size = declared
    path = write_gguf_moe(
        model, tmp_path / "broken.gguf", "qwen3moe", lambda _: "Q8_0", **write_kwargs
    )
    with pytest.raises(ValueError, match=error):
        _qlens_model(path)


@pytest.mark.parametrize("kind", ["Q8_0", "F32"])  # a packed linear, a float one
def test_linears_that_do_not_match_the_config_raise_naming_the_tensor(tmp_path, kind):
    model = make_gguf_moe("qwen2moe", shared_width=512)
    model.config.shared_expert_intermediate_size = 5632  # what the metadata will say
    path = write_gguf_moe(model, tmp_path / "shared.gguf", "qwen2moe", lambda _: kind)
    with pytest.raises(
        ValueError, match=r"shared\.gguf: blk\.0\.ffn_gate_shexp\.weight holds a \[512, 256\] "
        r"weight, but model\.layers\.0\.mlp\.shared_expert\.gate_proj\.weight .* is \[5632, 256\]",
    ):  # fmt: skip
        _qlens_model(path)


# stacked experts, or one tensor per expert as llama.cpp wrote Mixtral before stacking them
EXPERT_TENSORS = {
    "blk.0.ffn_gate_exps.weight": (4, 512, 256),
    "blk.0.ffn_gate.0.weight": (512, 256),
}


@pytest.mark.parametrize("name", EXPERT_TENSORS)
def test_llama_file_with_experts_but_no_expert_count_is_refused(tmp_path, name):
    experts = {name: np.zeros(EXPERT_TENSORS[name], dtype=np.float32)}
    path = write_gguf_llama(make_gguf_llama(), tmp_path / "mixtral.gguf", lambda _: "Q8_0", experts)
    with pytest.raises(
        ValueError, match=rf"mixtral\.gguf holds expert tensors \({re.escape(name)}\), but the "
        r"'llama' model built from its metadata has no experts module for them \(a Mixtral file "
        r"says how many experts it has in llama\.expert_count",
    ):  # fmt: skip
        qlens.load(path, tokenizer=make_tiny_tokenizer())


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize(
    ("arch", "widths"),
    [("qwen3moe", {"expert_width": 512}), ("qwen2moe", {"expert_width": 256, "shared_width": 512})],
    ids=["qwen3moe", "qwen2moe"],
)
def test_expert_widths_come_from_the_file(tmp_path, arch, widths, kind):
    """transformers' GGUF config reader keeps the config classes' default expert widths;
    qlens takes the file's (``expert_feed_forward_length``, Qwen2-MoE's
    ``expert_shared_feed_forward_length``), so MoE files of any width load."""
    model = make_gguf_moe(arch, **widths)
    path = write_gguf_moe(model, tmp_path / "wide.gguf", arch, lambda _: kind)
    loaded = _qlens_model(path)
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(loaded.config, field, None) == getattr(model.config, field, None), field
    if kind == "F32":  # the file holds the model's own values: the same logits
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got, expected = loaded(ids).logits, model(ids).logits
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
        return
    expected_values = gguf_py_values(gguf.GGUFReader(str(path)))
    types = _file_types(path)
    for index, layer in enumerate(loaded.model.layers):
        assert_experts_are_the_files_blocks(layer.mlp.experts, index, types, expected_values)
