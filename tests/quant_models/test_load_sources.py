"""`qlens.load` on quantized sources: save_quantized directories, dequantize=True, quantize=scheme,
and checkpoints that do not load intact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import input_ids, make_model
from torch import nn

import qlens
from qlens.bridge import Bridge
from qlens.modules import QuantExperts, QuantLinear
from qlens.modules.serialization import load_quantized, save_quantized
from qlens.weights import W_Q


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids()).logits


def _quant_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}


def test_save_quantized_directory_loads_exactly(tmp_path: Path) -> None:
    quantized = qlens.quantize(make_model("llama"), "int4")
    save_quantized(quantized, tmp_path)
    bridge = qlens.load(tmp_path)
    assert sorted(_quant_modules(bridge.model)) == sorted(_quant_modules(quantized))
    assert torch.equal(_logits(bridge.model), _logits(quantized))
    assert torch.equal(_logits(bridge.model), _logits(load_quantized(tmp_path)))
    with pytest.raises(TypeError, match=r"written by qlens.save_quantized .* dtype cannot"):
        qlens.load(tmp_path, dtype=torch.bfloat16)
    assert bridge.tokenizer is None  # a bare model was saved: no tokenizer


def test_a_saved_bridge_reloads_with_its_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(95)} | {"[UNK]": 95}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    bridge = qlens.quantize(Bridge(make_model("llama"), tokenizer=tokenizer), "int8")
    save_quantized(bridge, tmp_path)
    again = qlens.load(tmp_path)
    assert again.to_tokens("w3 w7", prepend_bos=False).tolist() == [[3, 7]]
    tokens = again.to_tokens("w1 w2 w90", prepend_bos=False)
    with torch.no_grad():
        assert torch.equal(again(tokens), bridge(tokens))


@pytest.mark.parametrize(("family", "scheme"), [("llama", "int4"), ("mixtral", "mxfp4")])
def test_dequantize_true_gives_float_modules_with_the_exact_weights(
    tmp_path: Path, family: str, scheme: str
) -> None:
    quantized = qlens.quantize(make_model(family), scheme)
    save_quantized(quantized, tmp_path)
    model = qlens.load(tmp_path, dequantize=True).model
    assert not _quant_modules(model)
    for name, module in _quant_modules(quantized).items():
        floats = model.get_submodule(name)
        if isinstance(module, QuantLinear):
            assert type(floats) is nn.Linear, name
            assert torch.equal(floats.weight, qlens.dequantize(module)), name
        else:
            expected = qlens.dequantize(module.payload_for("gate_up"))
            stored = floats.gate_up_proj
            assert torch.equal(stored, expected) or torch.equal(stored.transpose(1, 2), expected)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.fixture(scope="module")
def bnb_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("bitsandbytes")
    path = tmp_path_factory.mktemp("float_llama")
    make_model("llama").save_pretrained(path)
    return path


def test_the_guards_remedy_runs_as_written(bnb_checkpoint: Path) -> None:
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    bridge = qlens.load(bnb_checkpoint, quantization_config=config)
    with pytest.raises(NotImplementedError) as error:
        W_Q(bridge, 0)
    remedy = re.search(r"qlens\.load\(path, dequantize=True\)", str(error.value))
    assert remedy is not None, str(error.value)
    call = remedy.group(0).replace("path", "str(path), quantization_config=config")
    floats = eval(call, {"qlens": qlens, "path": bnb_checkpoint, "config": config})  # noqa: S307
    for name, module in bridge.model.named_modules():
        if type(module).__name__ == "Linear4bit":
            linear = floats.model.get_submodule(name)
            assert type(linear) is nn.Linear
            assert torch.equal(linear.weight, qlens.dequantize(module)), name
    expected = W_Q(bridge, 0, dequantize=True).to(torch.float32)
    assert torch.equal(W_Q(floats, 0), expected)
    # The other routes the message names work as written too.
    assert "bridge.dequantized() context" in str(error.value)
    with bridge.dequantized():
        assert torch.equal(W_Q(bridge, 0).to(torch.float32), expected)
    assert "qlens.dequantize(module)" in str(error.value)
    q_proj = bridge.model.model.layers[0].self_attn.q_proj
    assert torch.equal(
        qlens.dequantize(q_proj), floats.model.model.layers[0].self_attn.q_proj.weight
    )


@pytest.mark.parametrize(
    ("family", "scheme"),
    [
        ("llama", "int4"),
        ("llama", "mxfp4"),
        ("qwen3_moe", "nvfp4"),
        ("mixtral", "int8"),
        ("gpt_oss", "mxfp4"),
    ],
)
def test_quantize_on_load_equals_quantize_after_load(
    tmp_path: Path, family: str, scheme: str
) -> None:
    make_model(family).save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2  # streamed across several shards
    streamed = qlens.load(tmp_path, quantize=scheme).model
    reference = qlens.quantize(qlens.load(tmp_path).model, scheme)
    assert sorted(_quant_modules(streamed)) == sorted(_quant_modules(reference))
    before, after = reference.state_dict(), streamed.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert torch.equal(_logits(streamed), _logits(reference))
    assert streamed.lm_head.weight is streamed.model.embed_tokens.weight or (
        not reference.config.tie_word_embeddings
    )


def test_quantize_on_load_refuses_incomplete_and_foreign_checkpoints(tmp_path: Path) -> None:
    make_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors model\.layers\.0\.mlp\.down_proj\.weight"):
        qlens.load(tmp_path, quantize="int4")
    with pytest.raises(ValueError, match=r"down_proj\.weight.*qlens refuses it"):
        qlens.load(tmp_path)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(128, 256)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensors model\.layers\.0\.mlp\.extra\.weight that"):
        qlens.load(tmp_path, quantize="int4")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        qlens.load(tmp_path, quantize="int3")
    with pytest.raises(TypeError, match="either dequantize=True or quantize=scheme"):
        qlens.load(tmp_path, quantize="int4", dequantize=True)


def test_quantized_checkpoint_with_unexpected_tensors_is_refused(tmp_path: Path) -> None:
    from qlens.load_checks import require_complete_load

    model = make_model("llama")
    model.config.quantization_config = {"quant_method": "fp8"}
    info = {"missing_keys": [], "unexpected_keys": ["model.layers.0.mlp.up_proj.weight_scale"]}
    with pytest.raises(ValueError) as error:
        require_complete_load(model, info, "ckpt")
    assert "unexpected (left unused): model.layers.0.mlp.up_proj.weight_scale" in str(error.value)
    require_complete_load(make_model("llama"), {"unexpected_keys": ["x"]}, "float")


def test_float_experts_of_a_quantizing_config_are_refused() -> None:
    from qlens.load_checks import float_experts_problems, require_complete_load

    model = make_model("qwen3_moe")
    model.config.quantization_config = {"quant_method": "compressed-tensors", "ignore": ["lm_head"]}
    found = float_experts_problems(model)
    assert found and all(".mlp.experts (torch.float32)" in item for item in found)
    with pytest.raises(ValueError, match=r"quantized by the config \(compressed-tensors\)"):
        require_complete_load(model, {}, "ckpt")
    model.config.quantization_config["ignore"] = ["re:.*mlp.experts$", "lm_head"]
    assert float_experts_problems(model) == []
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    assert float_experts_problems(model) == []  # bnb quantizes nn.Linear only
