"""`qlens.load`: every kind of source, the dtype policy, and the errors for bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_llama, make_tiny_tokenizer
from transformers import AutoModelForCausalLM, BertConfig, BertModel

import qlens
from qlens.bridge import Bridge

TOKENS = torch.tensor([[0, 5, 9, 2, 17]])


def _hf_logits(directory: Path, **kwargs) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def test_directory_loads_in_float32_with_its_tokenizer(tiny_llama_dir):
    bridge = qlens.load(tiny_llama_dir)
    assert isinstance(bridge, Bridge)
    assert {p.dtype for p in bridge.model.parameters()} == {torch.float32}
    assert bridge.to_tokens("w3 w7", prepend_bos=False).tolist() == [[3, 7]]
    with torch.no_grad():
        assert torch.equal(bridge(TOKENS), _hf_logits(tiny_llama_dir, dtype=torch.float32))


def test_dtype_and_device_are_applied(tiny_llama_dir):
    bridge = qlens.load(str(tiny_llama_dir), dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in bridge.model.parameters()} == {torch.bfloat16}
    assert {p.device for p in bridge.model.parameters()} == {torch.device("cpu")}
    with pytest.raises(TypeError, match=r"either device= or device_map="):
        qlens.load(tiny_llama_dir, device="cpu", device_map="cpu")


def test_directory_without_tokenizer_gives_a_bridge_for_token_ids(tiny_llama_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_llama_dir / name).unlink()
    bridge = qlens.load(tiny_llama_dir)
    assert bridge.tokenizer is None
    with torch.no_grad():
        assert bridge(TOKENS).shape == (1, 5, 64)


def test_hub_id_is_read_from_the_local_cache(tiny_llama_dir, tmp_path):
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--qlens-test--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / revision)

    bridge = qlens.load("qlens-test/tiny-llama", cache_dir=str(cache))
    assert bridge.to_tokens("w4", prepend_bos=False).tolist() == [[4]]
    with torch.no_grad():
        assert torch.equal(bridge(TOKENS), _hf_logits(tiny_llama_dir, dtype=torch.float32))


def test_hub_id_missing_from_the_cache_says_how_to_download(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"local Hugging Face cache.*local_files_only=False"
    ):
        qlens.load("qlens-test/not-downloaded", cache_dir=str(tmp_path))


def test_loaded_model_is_wrapped_without_copy(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    bridge = qlens.load(model)
    assert bridge.model is model
    assert {name: p.data_ptr() for name, p in bridge.model.named_parameters()} == before
    # The tokenizer saved next to the checkpoint is found.
    assert bridge.to_tokens("w8", prepend_bos=False).tolist() == [[8]]


def test_dispatched_model_is_wrapped_without_copy(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, device_map="cpu")
    before = [p.data_ptr() for p in model.parameters()]
    bridge = qlens.load(model)
    assert [p.data_ptr() for p in bridge.model.parameters()] == before


def test_quantized_model_is_wrapped_without_copy(tiny_llama_dir):
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=config, device_map="cpu"
    )
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.int8
    before = [p.data_ptr() for p in model.parameters()]
    bridge = qlens.load(model)
    assert [p.data_ptr() for p in bridge.model.parameters()] == before
    with torch.no_grad():
        assert torch.equal(bridge(TOKENS), model(TOKENS).logits)


def test_model_tokenizer_pair():
    model = make_tiny_llama()
    bridge = qlens.load((model, make_tiny_tokenizer()))
    assert bridge.model is model
    assert bridge.to_tokens("w1 w2 zz", prepend_bos=False).tolist() == [[1, 2, 63]]


def test_loaded_model_refuses_dtype_and_device():
    with pytest.raises(TypeError, match=r"wraps an already-loaded model as it is, so dtype"):
        qlens.load(make_tiny_llama(), dtype=torch.float16)
    with pytest.raises(TypeError, match=r"so device cannot be applied"):
        qlens.load(make_tiny_llama(), device="cpu")


def test_missing_path_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Model path '.*nowhere' does not exist"):
        qlens.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        qlens.load("./no/such/model/dir")


def test_directory_without_config_is_reported(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        qlens.load(tmp_path)


def test_file_instead_of_directory_is_reported(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"is a file, not a model directory"):
        qlens.load(tiny_llama_dir / "config.json")


def _tiny_bert() -> BertModel:
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    return BertModel(config)


def test_encoder_directory_is_not_a_causal_lm(tmp_path):
    _tiny_bert().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"BertModel model, which is not a causal language model"):
        qlens.load(tmp_path)


def test_loaded_encoder_is_not_a_causal_lm():
    with pytest.raises(ValueError, match=r"BertModel is not a causal language model"):
        qlens.load(_tiny_bert())


def test_other_objects_are_refused():
    with pytest.raises(TypeError, match=r"got Linear"):
        qlens.load(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"pair, got a tuple of 3 items"):
        qlens.load((make_tiny_llama(), None, None))


def test_pickled_weights_need_an_explicit_opt_in(tiny_llama_dir, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", pickled)
    state = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"only pickled weights \(pytorch_model\.bin\).*use_safetensors=False"
    ):
        qlens.load(pickled)
    bridge = qlens.load(pickled, use_safetensors=False)
    with torch.no_grad():
        assert torch.equal(bridge(TOKENS), _hf_logits(tiny_llama_dir, dtype=torch.float32))


def test_custom_code_is_not_run_unless_trusted(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qlens_custom", "architectures": ["CustomForCausalLM"], '
        '"auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}'
    )
    (tmp_path / "configuration_custom.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('EXECUTED').write_text('yes')\n"
    )
    with pytest.raises(ValueError, match=r"trust_remote_code=True"):
        qlens.load(tmp_path)
    assert not (tmp_path / "EXECUTED").exists()
