"""Adopting compressed-tensors Linear modules (built and compressed with its own API on CPU)
against compressed-tensors' decompression of the same module."""

import json
import warnings

import pytest
import torch
from torch import nn

ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationStrategy as Strategy  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

from qlens.quant.adopt import adopt_module, is_quantized_module  # noqa: E402
from qlens.quant.codecs.registry import dequantizer_for  # noqa: E402
from qlens.quant.dequantize import dequantize  # noqa: E402
from qlens.report.audit import audit_weights  # noqa: E402
from qlens.weights.storage import unreadable_weights  # noqa: E402


def _calibrate(module):
    """Weight-only min/max calibration, as llm-compressor would do it."""
    args, w, global_scale = module.quantization_scheme.weights, module.weight.data, None
    if args.strategy == Strategy.TENSOR:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == Strategy.CHANNEL:
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
        grouped = w.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
        if args.strategy == Strategy.TENSOR_GROUP:
            global_scale = generate_gparam(w.amin(), w.amax())
            module.weight_global_scale.data.copy_(global_scale)
    else:
        rows, cols = args.block_structure
        blocks = w.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero = calculate_qparams(low, high, args, global_scale=global_scale)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(
        module.weight_scale.shape
    )
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )


def _compressed_model(preset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128))
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_quant.apply_quantization_config(
            model, ct_quant.QuantizationConfig(config_groups={"g": scheme})
        )
        _calibrate(model[0])
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    return model, compressor


@pytest.mark.parametrize(
    "preset,format_name",
    [
        ("W4A16", "int4"),
        ("W4A16_ASYM", "int4"),
        ("W8A16", "int8"),
        ("W8A8", "int8"),
        ("FP8_BLOCK", "fp8_block"),
        ("FP8_DYNAMIC", "fp8_block"),
        ("NVFP4A16", "nvfp4"),
        ("MXFP4A16", "mxfp4"),
        ("MXFP8A16", "mxfp8"),
    ],
)
def test_adopt_matches_decompression(preset, format_name):
    model, compressor = _compressed_model(preset)
    module = model[0]
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.format.name == format_name and payload.shape == (128, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compressor.decompress_model(model)
    expected = module.weight.detach()
    # compressed-tensors decompresses NVFP4/MX weights to bfloat16; both compute in float32 and
    # round once, so the comparison is exact in the decompressed dtype.
    got = dequantizer_for(payload.format.name)(payload, expected.dtype)
    assert torch.equal(got, expected)
    assert not is_quantized_module(module)  # decompressed: a plain float weight now


def _llama_checkpoint(path, preset):
    """A one-layer Llama compressed with compressed-tensors' own compressor, as saved by it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_quant.apply_quantization_config(
            model, ct_quant.QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"])
        )
        for module in model.modules():
            if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
                _calibrate(module)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        model.save_pretrained(path)
        compressor.update_config(path)
    return path


@pytest.mark.parametrize("preset", ["W4A16", "FP8_BLOCK"])
def test_checkpoint_loaded_by_transformers_before_and_after_first_forward(tmp_path, preset):
    from transformers import LlamaForCausalLM

    path = _llama_checkpoint(tmp_path, preset)  # every projection a multiple of 128 x 128
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = LlamaForCausalLM.from_pretrained(path)
    quantized = {name: m for name, m in loaded.named_modules() if is_quantized_module(m)}
    assert len(quantized) == 7  # q, k, v, o, gate, up, down
    adopted = {name: dequantize(adopt_module(m)) for name, m in quantized.items()}
    loaded(torch.tensor([[1, 2, 3]]))  # the library's own route decompresses in place
    for name, module in quantized.items():
        assert not is_quantized_module(module)
        assert torch.equal(adopted[name], module.weight.detach())
    # the int64 `weight_shape` each module keeps is bookkeeping, not an unreadable weight
    assert unreadable_weights(loaded) == []
    assert not any(row.name.endswith("weight_shape") for row in audit_weights(loaded).rows)


def _decompressed_reference(path, dtype):
    """The checkpoint as compressed-tensors runs it: decompressed in place, in ``dtype``."""
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(path, dtype="auto")
        # what the model's first forward runs before computing (the pre-hook removes itself)
        model._forward_pre_hooks[model.ct_decompress_hook.id](model, ())
    assert not hasattr(model, "ct_decompress_hook")
    return model.to(dtype)


@pytest.mark.parametrize(
    "preset,format_name",
    [
        ("W4A16", "int4"),
        ("W8A16", "int8"),
        ("NVFP4A16", "nvfp4"),
        ("MXFP4A16", "mxfp4"),
        ("MXFP8A16", "mxfp8"),
    ],
)
def test_qlens_load_keeps_modules_packed_through_forwards(tmp_path, preset, format_name):
    import qlens
    from qlens.weights import W_Q

    path = _llama_checkpoint(tmp_path, preset)
    ids = torch.tensor([[1, 2, 3, 4]])
    bridge = qlens.load(path, dtype=torch.float32)
    quantized = {n: m for n, m in bridge.model.named_modules() if is_quantized_module(m)}
    assert len(quantized) == 7 and sorted(bridge.rerouted) == sorted(quantized)
    adopted = {n: dequantize(adopt_module(m)) for n, m in quantized.items()}
    with torch.no_grad():
        logits = bridge(ids)
        assert torch.equal(bridge(ids), logits)
    # no in-place decompression: still packed, the same payloads, the guard still refuses
    assert all(is_quantized_module(m) for m in quantized.values())
    assert all(torch.equal(dequantize(m), adopted[n]) for n, m in quantized.items())
    with pytest.raises(NotImplementedError, match="compressed-tensors"):
        W_Q(bridge, 0)
    reference = _decompressed_reference(path, torch.float32)
    q_proj = "model.layers.0.self_attn.q_proj"
    decompressed = reference.get_submodule(q_proj).weight
    # compressed-tensors decompresses NVFP4/MX to bf16, rounding once: equal in that dtype
    assert torch.equal(
        dequantize(quantized[q_proj], torch.bfloat16 if preset != "W4A16" else decompressed.dtype),
        decompressed.to(torch.bfloat16 if preset != "W4A16" else decompressed.dtype),
    )
    if preset in ("W4A16", "W8A16"):  # integer codes times fp32 scales: the same fp32 weights
        with torch.no_grad():
            assert torch.equal(logits, reference(ids).logits)
    rows = audit_weights(bridge.model).rows
    assert {r.format for r in rows if not r.readable} == {format_name}
    assert not any(r.name.endswith("weight_shape") for r in rows)


def test_restoring_the_own_forward_gives_back_the_library_route(tmp_path):
    import qlens
    from qlens.modules.reroute import restore_own_forward

    bridge = qlens.load(_llama_checkpoint(tmp_path, "W8A16"))
    model = bridge.model
    assert not hasattr(model, "ct_decompress_hook")  # detached while rerouted
    assert len(restore_own_forward(model)) == 7
    assert hasattr(model, "ct_decompress_hook")
    q_proj = model.model.layers[0].self_attn.q_proj
    expected = dequantize(q_proj)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors' own route: decompress in place
    assert not is_quantized_module(q_proj)
    assert torch.equal(q_proj.weight.detach(), expected)


def test_asymmetric_packed_checkpoint_is_refused_with_its_cause(tmp_path):
    import qlens

    path = _llama_checkpoint(tmp_path, "W4A16_ASYM")
    with pytest.raises(ValueError, match=r"zero points are stored packed.*upstream"):
        qlens.load(path)


def _moe_checkpoint(path, family, preset):
    """A one-layer MoE whose experts are saved as llm-compressor saves them: one compressed
    linear per expert projection (Qwen3-MoE gate/up/down_proj, Mixtral w1/w3/w2)."""
    from safetensors.torch import save_file
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts_per_tok=1,
    )  # fmt: skip
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**sizes, moe_intermediate_size=128, num_experts=2, mlp_only_layers=[])
        )
        names = ("gate_proj", "up_proj", "down_proj")
    else:
        model = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=2))
        names = ("w1", "w3", "w2")
    fused = model.model.layers[0].mlp.experts
    experts = nn.ModuleDict()
    for e in range(2):
        gate, up = fused.gate_up_proj[e].detach().chunk(2)
        projections = nn.ModuleDict()
        for name, weight in zip(names, (gate, up, fused.down_proj[e].detach()), strict=True):
            projections[name] = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            projections[name].weight.data = weight.clone()
        experts[str(e)] = projections
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_quant.apply_quantization_config(
            experts, ct_quant.QuantizationConfig(config_groups={"g": scheme})
        )
        for module in experts.modules():
            if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
                _calibrate(module)
        compressor = ModelCompressor.from_pretrained_model(experts)
        compressor.compress_model(experts)
    state = {k: v for k, v in model.state_dict().items() if ".mlp.experts." not in k}
    prefix = "model.layers.0.mlp.experts."
    state.update({prefix + k: v.contiguous() for k, v in experts.state_dict().items()})
    model.config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_loaded_wrongly_by_transformers_are_refused(tmp_path, family):
    import qlens

    path = _moe_checkpoint(tmp_path, family, "NVFP4A16")
    with pytest.raises(ValueError, match=r"did not load the compressed-tensors experts of "
                       r"model\.layers\.0\.mlp\.experts .*weight_global_scale"):  # fmt: skip
        qlens.load(path)


def test_moe_experts_dequantized_exactly_by_transformers_load_are_refused(tmp_path, caplog):
    """Exact but float experts of a quantized checkpoint are still refused: the config says they
    are packed, and a model twice their size with no quantized forward is not what was asked."""
    import qlens

    path = _moe_checkpoint(tmp_path, "qwen3_moe", "W8A16")
    with pytest.raises(ValueError, match=r"loaded as float: model\.layers\.0\.mlp\.experts"):
        qlens.load(path)
    assert "arrived dequantized to torch.float32" in caplog.text
