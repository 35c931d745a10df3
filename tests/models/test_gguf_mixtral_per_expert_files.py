"""`qlens.load` on Mixtral GGUF files as llama.cpp wrote them before it stacked the experts: one
tensor per expert, ``blk.N.ffn_{gate,up,down}.E.weight``. Each projection's experts are stacked
into the same packed ``QuantExperts`` a stacked file gives (expert E's blocks are the bytes of
``blk.N.ffn_*.E.weight``), so the model equals the one loaded from the same weights written
stacked, and predicts like a float Mixtral holding gguf-py's values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    float_mixtral,
    gguf_py_values,
    make_gguf_mixtral,
    write_gguf_llama,
)
from gguf_moe_files import (  # noqa: E402
    assert_experts_are_the_files_blocks,
    assert_holds_the_weights_of,
    assert_reloads_with_the_same_gguf_experts,
    moe_type_of,
)
from model_fixtures import make_tiny_tokenizer  # noqa: E402

import qlens  # noqa: E402
from qlens.modules import QuantExperts, QuantLinear  # noqa: E402

N_LAYERS, N_EXPERTS, INTERMEDIATE = 2, 4, 512
PACKED_KINDS = ("Q8_0", "Q4_0", "Q4_K", "mixed")  # "mixed": Q4_K, the experts' down Q6_K
FLOAT_KINDS = ("F16", "BF16", "F32")  # float in the file: float experts, as when stacked
KINDS = (*PACKED_KINDS, *FLOAT_KINDS)
TOKENS = torch.tensor([[3, 17, 42, 8, 63, 5, 29]])
PARTS = ("gate", "up", "down")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per kind, the same weights written one tensor per expert and stacked."""
    folder = tmp_path_factory.mktemp("gguf_mixtral_per_expert")
    model = make_gguf_mixtral()
    return {
        kind: {
            layout: write_gguf_llama(
                model,
                folder / f"tiny-{layout}-{kind}.gguf",
                moe_type_of(kind),
                per_expert=layout == "per-expert",
            )
            for layout in ("per-expert", "stacked")
        }
        for kind in KINDS
    }


@pytest.fixture(scope="module")
def bridges(files) -> dict[str, dict[str, qlens.Bridge]]:
    return {
        kind: {
            layout: qlens.load(path, tokenizer=make_tiny_tokenizer())
            for layout, path in pair.items()
        }
        for kind, pair in files.items()
    }


def test_the_files_hold_one_tensor_per_expert(files):
    reader = gguf.GGUFReader(str(files["Q4_K"]["per-expert"]))
    names = {t.name: list(reversed(t.shape.tolist())) for t in reader.tensors}
    assert not [name for name in names if "_exps" in name]
    for layer in range(N_LAYERS):
        for expert in range(N_EXPERTS):
            assert names[f"blk.{layer}.ffn_gate.{expert}.weight"] == [INTERMEDIATE, 256]
            assert names[f"blk.{layer}.ffn_up.{expert}.weight"] == [INTERMEDIATE, 256]
            assert names[f"blk.{layer}.ffn_down.{expert}.weight"] == [256, INTERMEDIATE]


@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_experts_are_packed_from_each_experts_blocks(files, bridges, kind):
    reader = gguf.GGUFReader(str(files[kind]["per-expert"]))
    tensors = {t.name: t for t in reader.tensors}
    values = gguf_py_values(reader)  # gguf-py's own dequantize of each per-expert tensor
    model, stacked = bridges[kind]["per-expert"].model, bridges[kind]["stacked"].model
    assert not [n for n, p in model.named_parameters() if p.ndim == 3]  # no float experts
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts

        def per_expert(part: str, expert: int, index: int = index) -> str:
            return f"blk.{index}.ffn_{part}.{expert}.weight"

        stacked_names = {part: f"blk.{index}.ffn_{part}_exps.weight" for part in PARTS}
        types = {stacked_names[p]: tensors[per_expert(p, 0)].tensor_type.name for p in PARTS}
        expected = {
            stacked_names[p]: np.stack([values[per_expert(p, e)] for e in range(N_EXPERTS)])
            for p in PARTS
        }
        assert_experts_are_the_files_blocks(experts, index, types, expected, N_EXPERTS)
        gate_up, down = experts.payload["gate_up_proj"].data, experts.payload["down_proj"].data
        for expert in range(N_EXPERTS):  # expert E's slice: the bytes of its own tensors
            for blocks, part in ((gate_up[expert, :INTERMEDIATE], "gate"),
                                 (gate_up[expert, INTERMEDIATE:], "up"),
                                 (down[expert], "down")):  # fmt: skip
                file_blocks = np.asarray(tensors[per_expert(part, expert)].data)
                np.testing.assert_array_equal(blocks.numpy(), file_blocks)
        theirs = stacked.model.layers[index].mlp.experts
        for name, payload in experts.payload.items():  # the stacked file's payloads, exactly
            assert payload.format == theirs.payload[name].format, name
            assert payload.layout == theirs.payload[name].layout, name
            assert torch.equal(payload.data, theirs.payload[name].data), name


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_the_stacked_files_and_match_a_float_mixtral(files, bridges, kind):
    per_expert, stacked = bridges[kind]["per-expert"], bridges[kind]["stacked"]
    floats = dict(stacked.model.named_parameters())  # float kinds: the experts too
    names = [name for name, _ in per_expert.model.named_parameters()]
    assert sorted(names) == sorted(floats)
    for name, tensor in per_expert.model.named_parameters():
        assert torch.equal(tensor, floats[name]), name
    experts = type(per_expert.model.model.layers[0].mlp.experts).__name__
    assert experts == ("MixtralExperts" if kind in FLOAT_KINDS else "QuantExperts")
    with torch.no_grad():
        ours, same_bytes = per_expert(TOKENS), stacked(TOKENS)
        theirs = float_mixtral(files[kind]["stacked"], stacked.model.config)(TOKENS).logits
    assert torch.equal(ours, same_bytes)
    # As in test_gguf_mixtral_files: the same float32 weights and routers, so the same experts;
    # only the matmul summation order differs (a few ulps per <= 512-term dot, two layers).
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())


def test_dequantize_on_load_gives_the_float_mixtral(files):
    path = files["mixed"]["per-expert"]
    floats = qlens.load(path, dequantize=True, tokenizer=make_tiny_tokenizer())
    assert not any(isinstance(m, (QuantExperts, QuantLinear)) for m in floats.model.modules())
    reference = float_mixtral(files["mixed"]["stacked"], floats.model.config)
    expected = dict(reference.named_parameters())
    assert sorted(n for n, _ in floats.model.named_parameters()) == sorted(expected)
    for name, tensor in floats.model.named_parameters():
        assert torch.equal(tensor, expected[name]), name


def test_bfloat16_load_equals_the_stacked_files(files):
    per_expert, stacked = (
        qlens.load(files["mixed"][layout], dtype=torch.bfloat16, tokenizer=make_tiny_tokenizer())
        for layout in ("per-expert", "stacked")
    )
    assert_holds_the_weights_of(
        per_expert.model, float_mixtral(files["mixed"]["stacked"], stacked.model.config).bfloat16()
    )
    with torch.no_grad():
        assert torch.equal(per_expert(TOKENS), stacked(TOKENS))


def test_saved_per_expert_mixtral_reloads_with_the_same_gguf_experts(bridges, tmp_path):
    bridge = bridges["Q4_K"]["per-expert"]
    reloaded = assert_reloads_with_the_same_gguf_experts(bridge, tmp_path, TOKENS)
    assert type(reloaded).__name__ == "MixtralForCausalLM"


_ZEROS = np.zeros((INTERMEDIATE, 256), dtype=np.float32)
_UP_TYPES = "blk\\.1\\.ffn_up\\.{}\\.weight {}"
# write kwargs, the error
BROKEN = {
    "mixed-types-in-one-projection": (
        {"retype": {"blk.1.ffn_up.2.weight": "Q4_0"}},
        r"broken\.gguf: the experts of blk\.1\.ffn_up_exps are stored one tensor each in "
        r"different GGML types \("
        + ", ".join(_UP_TYPES.format(e, "Q4_0" if e == 2 else "Q8_0") for e in range(N_EXPERTS))
        + r"\); qlens stacks one projection's experts into one packed tensor, which holds one "
        r"type\. Requantize the file so that each projection's experts share a type",
    ),
    "missing-expert": (
        {"omit": ("blk.1.ffn_down.3.weight",)},
        r"broken\.gguf lacks blk\.1\.ffn_down\.3\.weight: the file stores its experts one tensor "
        r"each \(blk\.N\.ffn_\{gate,up,down\}\.E\.weight, .*\), and each layer needs all three "
        r"projections of every expert, E = 0\.\.3 \(llama\.expert_count=4\)\. The file is "
        r"incomplete",
    ),
    "missing-projection": (
        {"omit": tuple(f"blk.0.ffn_up.{e}.weight" for e in range(N_EXPERTS))},
        r"broken\.gguf lacks blk\.0\.ffn_up\.0\.weight, blk\.0\.ffn_up\.1\.weight, "
        r"blk\.0\.ffn_up\.2\.weight, blk\.0\.ffn_up\.3\.weight: ",
    ),
    "expert-beyond-the-count": (
        {"extra": {"blk.0.ffn_gate.4.weight": _ZEROS}},
        r"broken\.gguf holds blk\.0\.ffn_gate\.4\.weight, but its metadata numbers the experts "
        r"E = 0\.\.3 \(llama\.expert_count=4\): the file does not match its own metadata",
    ),
    "experts-of-different-shapes": (
        {
            "omit": ("blk.0.ffn_gate.1.weight",),
            "extra": {"blk.0.ffn_gate.1.weight": _ZEROS[:256]},
            "type_of": lambda _: "F32",
        },
        r"broken\.gguf: the experts of blk\.0\.ffn_gate_exps are stored one tensor each in "
        r"different shapes \(blk\.0\.ffn_gate\.0\.weight \[512, 256\], blk\.0\.ffn_gate\.1\.weight \[256, 256\], "
        r"blk\.0\.ffn_gate\.2\.weight \[512, 256\], blk\.0\.ffn_gate\.3\.weight \[512, 256\]\); "
        r"every expert of a projection has the same shape \[out, in\], so the file is broken",
    ),
    "experts-narrower-than-the-config": (
        {
            "omit": tuple(f"blk.0.ffn_gate.{e}.weight" for e in range(N_EXPERTS)),
            "extra": {f"blk.0.ffn_gate.{e}.weight": _ZEROS[:256] for e in range(N_EXPERTS)},
            "type_of": lambda _: "F32",
        },
        r"broken\.gguf: blk\.0\.ffn_gate\.\{0\.\.3\}\.weight has shape \[4, 256, 256\] "
        r"\[experts, out, in\], but the model built from the file's config expects "
        r"\[4, 512, 256\] at model\.layers\.0\.mlp\.experts",
    ),
    "stacked-and-per-expert": (
        {
            "extra": {
                "blk.0.ffn_gate_exps.weight": np.zeros((N_EXPERTS, INTERMEDIATE, 256), np.float32)
            }
        },
        r"broken\.gguf holds the experts of model\.layers\.0\.mlp\.experts twice, stacked and one "
        r"tensor per expert \(blk\.0\.ffn_gate_exps\.weight, blk\.0\.ffn_gate\.\{0\.\.3\}\.weight, ",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_per_expert_files_raise_naming_what_is_wrong(tmp_path, case):
    write_kwargs, error = dict(BROKEN[case][0]), BROKEN[case][1]
    type_of = write_kwargs.pop("type_of", lambda _: "Q8_0")
    path = write_gguf_llama(
        make_gguf_mixtral(), tmp_path / "broken.gguf", type_of, per_expert=True, **write_kwargs
    )
    with pytest.raises(ValueError, match=error):
        qlens.load(path, tokenizer=make_tiny_tokenizer())
