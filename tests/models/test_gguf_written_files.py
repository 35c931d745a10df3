"""`qlens.load` on GGUF files written by gguf-py (tiny random Llamas), one file per GGML type and
one with mixed types: packed weights decode to exactly gguf-py's values, and the bridge predicts
like transformers' own (dequantizing) GGUF loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    K_QUANT_F16_OFFSETS,
    QUANTIZABLE,
    gguf_py_values,
    make_gguf_llama,
    permute_rows,
    transformers_gguf_model,
    write_gguf_llama,
    write_out,
)
from model_fixtures import make_tiny_tokenizer  # noqa: E402

import qlens  # noqa: E402
from qlens.modules import QuantLinear  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402
from qlens.weights import W_Q  # noqa: E402

# gguf-py quantizes these itself; the K-quants are random valid blocks in gguf-py's layout.
TYPES = (*QUANTIZABLE, *K_QUANT_F16_OFFSETS)
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
N_LAYERS, N_HEADS, N_KV_HEADS = 2, 4, 2
# llama.cpp's Q4_K_M-like mix: most linears Q4_K, attn_v / ffn_down Q6_K, output Q8_0, one Q5_0.
MIXED = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q8_0", "attn_output": "Q5_0"}


def _mixed_type(name: str) -> str:
    kind = name.split(".")[-2]
    return MIXED.get(kind, "Q4_K")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    model = make_gguf_llama()
    written = {
        t: write_gguf_llama(model, folder / f"tiny-{t}.gguf", lambda _, t=t: t) for t in TYPES
    }
    written["mixed"] = write_gguf_llama(model, folder / "tiny-mixed.gguf", _mixed_type)
    return written


def _file_type(reader: object, name: str) -> str:
    return next(t.tensor_type.name for t in reader.tensors if t.name == name)  # type: ignore[attr-defined]


def _gguf_name(hf_name: str) -> str:
    if hf_name == "lm_head":
        return "output.weight"
    _, _, index, block, leaf = hf_name.split(".")
    kinds = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    kinds |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    return f"blk.{index}.{kinds[leaf]}.weight"


@pytest.mark.parametrize("kind", [*TYPES, "mixed"])
def test_linears_stay_gguf_blocks_that_decode_to_gguf_py_values(files, kind):
    path = files[kind]
    reader = gguf.GGUFReader(str(path))
    expected = gguf_py_values(reader)
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    quantized = {n: m for n, m in bridge.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == N_LAYERS * LINEARS_PER_LAYER + 1  # and lm_head
    for name, module in quantized.items():
        gguf_name = _gguf_name(name)
        assert module.payload.format.name == f"gguf_{_file_type(reader, gguf_name).lower()}", name
        assert module.payload.data.dtype == torch.uint8, name
        values = qlens.dequantize(module).numpy()
        if name.endswith("q_proj"):
            values = permute_rows(values, N_HEADS)  # the file's row order
        elif name.endswith("k_proj"):
            values = permute_rows(values, N_KV_HEADS)
        np.testing.assert_array_equal(values, expected[gguf_name], err_msg=name)
    formats = sorted({m.payload.format.name for m in quantized.values()})
    if kind == "mixed":
        assert formats == ["gguf_q4_k", "gguf_q5_0", "gguf_q6_k", "gguf_q8_0"]
    else:
        assert formats == [f"gguf_{kind.lower()}"]
    assert audit_weights(bridge.model).formats == formats


@pytest.mark.parametrize("kind", [*TYPES, "mixed"])
def test_bridge_predicts_like_transformers_gguf_loader(files, kind):
    path = files[kind]
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    reference = transformers_gguf_model(path)
    for name, module in bridge.model.named_modules():
        if isinstance(module, QuantLinear):  # transformers un-permutes q/k rows the same way
            assert torch.equal(qlens.dequantize(module), reference.get_submodule(name).weight), name
    floats = dict(reference.named_parameters())
    for name, tensor in bridge.model.named_parameters():
        assert torch.equal(tensor, floats[name]), name
    tokens = torch.tensor([[3, 17, 42, 8, 63, 5, 29]])
    with torch.no_grad():
        ours, theirs = bridge(tokens), reference(tokens).logits
    # Identical float32 weights; the two paths differ only in matmul summation order (blocked
    # dequantize-then-matmul vs nn.Linear), a few ulps per dot product of <= 512 terms.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_0", "Q6_K", "mixed"])
def test_weight_reads_are_guarded_and_dequantize_loads_floats(files, kind):
    path = files[kind]
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    with pytest.raises(NotImplementedError, match="read W_Q of layer 0") as error:
        W_Q(bridge, 0)
    assert "gguf_" in str(error.value)
    with bridge.dequantized():
        packed_w_q = W_Q(bridge, 0)
    with qlens.dequantized():  # the process-wide opt-in reads the same values
        assert torch.equal(W_Q(bridge, 0), packed_w_q)
    with pytest.raises(NotImplementedError, match="read W_Q of layer 0"):
        W_Q(bridge, 0)  # refused again once the context has exited
    floats = qlens.load(path, dequantize=True, tokenizer=make_tiny_tokenizer())
    reference = dict(transformers_gguf_model(path).named_parameters())
    assert not any(isinstance(m, QuantLinear) for m in floats.model.modules())
    for name, tensor in floats.model.named_parameters():
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(W_Q(floats, 0), packed_w_q)


@pytest.mark.parametrize("kind", ["TQ1_0", "TQ2_0"])
def test_types_without_a_qlens_codec_load_as_gguf_py_floats(tmp_path, kind):
    path = write_gguf_llama(make_gguf_llama(), tmp_path / f"tiny-{kind}.gguf", lambda _: kind)
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    assert not any(isinstance(m, QuantLinear) for m in bridge.model.modules())
    reference = dict(transformers_gguf_model(path).named_parameters())
    for name, tensor in bridge.model.named_parameters():
        assert torch.equal(tensor, reference[name]), name
    expected = gguf_py_values(gguf.GGUFReader(str(path)))
    down = bridge.model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(down, expected["blk.1.ffn_down.weight"])


def test_file_without_an_architecture_is_refused(tmp_path):
    path = tmp_path / "nameless.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    del writer.kv_data[0]["general.architecture"]
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    write_out(writer, path)
    with pytest.raises(ValueError, match=r"nameless\.gguf has no general\.architecture in its"):
        qlens.load(path, tokenizer=make_tiny_tokenizer())
