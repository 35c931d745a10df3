"""The Bridge's TransformerLens model API, checked against TransformerLens 4.3 on the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from bridge_models import tiny_model
from tl_oracle import tl_bridge

import qlens
from qlens import Bridge
from qlens.modules.model_quantize import quantize

DENSE = ["llama", "gpt2", "qwen2", "gpt_neox", "phi3", "opt", "gemma2"]
WEIGHTS = ["W_E", "W_U", "b_U", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_out"]
BIASES = ["b_Q", "b_K", "b_V", "b_O", "b_in", "b_out"]
PROMPT = "the cat sat on the mat and the dog ran to the park"
# Logits of the two libraries come from the same HF modules but TL runs eager attention and qlens
# the model's default (sdpa): fp32 rounding of a 64-wide, 2-layer model stays far below 1e-5.
FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=DENSE)
def pair(request, word_tokenizer):
    model = tiny_model(request.param)
    return Bridge(model, word_tokenizer), tl_bridge(model, word_tokenizer)


def _tokens(tl):
    return tl.to_tokens(PROMPT)  # with TL's BOS; both sides get these ids


def test_weight_properties_equal_transformer_lens(pair):
    bridge, tl = pair
    for name in WEIGHTS:  # the same stored tensors, reshaped: exactly equal
        torch.testing.assert_close(getattr(bridge, name), getattr(tl, name), rtol=0, atol=0)
    gate = bridge.W_gate
    if tl.cfg.gated_mlp:
        torch.testing.assert_close(gate, tl.W_gate, rtol=0, atol=0)
    else:
        assert gate is None and tl.W_gate is None
    for name in BIASES:
        try:
            expected = getattr(tl, name)
        except AttributeError as error:  # TL 4.3 refuses biases the checkpoint lacks; qlens: 0
            assert "bias-free" in str(error)
            assert not getattr(bridge, name).any()
        else:
            torch.testing.assert_close(getattr(bridge, name), expected, rtol=0, atol=0)


def test_circuits_are_tl_factored_matrices(pair):
    bridge, tl = pair
    for name in ("QK", "OV"):
        ours, theirs = getattr(bridge, name), getattr(tl, name)
        assert isinstance(ours, qlens.weights.FactoredMatrix)
        torch.testing.assert_close(ours.A, theirs.A, rtol=0, atol=0)
        torch.testing.assert_close(ours.B, theirs.B, rtol=0, atol=0)


def test_grouped_kv_heads_are_stored_heads_as_in_tl(word_tokenizer):
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    assert bridge.W_K.shape == (2, bridge.cfg.n_kv_heads, 64, 16) and bridge.cfg.n_kv_heads == 2
    assert bridge.QK.shape == (2, 4, 64, 64)  # K repeated per query head


def test_w_pos(word_tokenizer):
    for arch in ("gpt2", "opt"):
        model = tiny_model(arch)
        bridge, tl = Bridge(model, word_tokenizer), tl_bridge(model, word_tokenizer)
        torch.testing.assert_close(bridge.W_pos, tl.W_pos, rtol=0, atol=0)
        torch.testing.assert_close(bridge.W_E_pos, tl.W_E_pos, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no learned position embedding .rotary positions"):
        _ = Bridge(tiny_model("llama"), word_tokenizer).W_pos


def test_config_names_tl_code_reads(pair):
    bridge, tl = pair
    c, t = bridge.cfg, tl.cfg
    for name in (
        "n_layers", "d_model", "n_heads", "d_head", "d_vocab", "d_vocab_out", "n_ctx",
        "n_key_value_heads", "normalization_type", "positional_embedding_type", "gated_mlp",
        "parallel_attn_mlp", "attn_only", "dtype", "device", "use_attn_result",
        "use_split_qkv_input", "use_hook_mlp_in", "n_devices",
    ):  # fmt: skip
        ours, theirs = getattr(c, name), getattr(t, name)
        expected = theirs if not (name == "n_key_value_heads" and theirs is None) else c.n_heads
        assert ours == expected, name
    assert c.d_mlp == tl.W_in.shape[-1]  # TL 4.3's cfg.d_mlp is 4 * d_model for OPT, not ffn_dim
    assert c.original_architecture == type(bridge.model).__name__
    assert c.tokenizer_prepends_bos is False
    assert c.default_prepend_bos == t.default_prepend_bos


def test_device_and_dtype_follow_the_model(word_tokenizer):
    model = copy.deepcopy(tiny_model("llama"))
    bridge = Bridge(model, word_tokenizer)
    assert bridge.to(torch.float64) is bridge
    assert model.dtype == torch.float64 and bridge.cfg.dtype == torch.float64
    assert bridge.cfg.device == "cpu" and bridge.device == torch.device("cpu")
    assert bridge.W_Q.dtype == torch.float64
    assert bridge.half() is bridge and bridge.cfg.dtype == torch.float16
    assert bridge.float() is bridge and bridge.cfg.dtype == torch.float32


def test_module_methods_are_the_models(word_tokenizer):
    model = copy.deepcopy(tiny_model("gpt2"))
    bridge = Bridge(model, word_tokenizer)
    assert [id(p) for p in bridge.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in bridge.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(bridge.state_dict()) == list(model.state_dict())
    assert [n for n, _ in bridge.named_modules()] == [n for n, _ in model.named_modules()]
    assert bridge.original_model is model and not bridge.training
    assert bridge.train() is bridge and model.training and bridge.training
    assert bridge.eval() is bridge and not model.training
    assert bridge.requires_grad_(False) is bridge
    assert not any(p.requires_grad for p in model.parameters())
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    bridge.load_state_dict(state)
    assert not bridge.W_E.any()
    assert not isinstance(bridge, torch.nn.Module)  # qlens tells a model from a bridge by this


def test_blocks_expose_hook_points_modules_and_weights(word_tokenizer):
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    assert len(bridge.blocks) == 2 and bridge.blocks[-1] is bridge.blocks[1]
    for name, point in bridge.hook_dict.items():
        if name.startswith("blocks."):
            _, layer, *path = name.split(".")
            view = bridge.blocks[int(layer)]
            for part in path:
                view = getattr(view, part)
            assert view is point
    attn = bridge.blocks[1].attn
    assert attn.hook_pattern is bridge.hook_dict["blocks.1.attn.hook_pattern"]
    assert attn.module is bridge.model.model.layers[1].self_attn
    assert attn.q_proj is bridge.model.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(attn.W_Q, bridge.W_Q[1], rtol=0, atol=0)
    torch.testing.assert_close(bridge.blocks[0].mlp.W_gate, bridge.W_gate[0], rtol=0, atol=0)
    with pytest.raises(AttributeError, match="blocks.1.attn has no hook point, weight or module"):
        _ = attn.hook_nonexistent
    assert bridge.mod_dict["blocks.1.attn"] is attn.module
    assert bridge.mod_dict["ln_final"] is bridge.ln_final
    assert bridge.mod_dict["blocks.0.hook_resid_pre"] is bridge.hook_dict["blocks.0.hook_resid_pre"]


def test_token_helpers_equal_transformer_lens(pair):
    bridge, tl = pair
    tokens = _tokens(tl)
    assert bridge.to_single_token("cat") == tl.to_single_token("cat")
    for mode in ("first", "last"):
        for token in ("the", bridge.to_single_token("the"), torch.tensor(5)):
            assert bridge.get_token_position(token, tokens, mode=mode) == tl.get_token_position(
                token, tokens, mode=mode
            )
        assert bridge.get_token_position(
            "the", PROMPT, mode=mode, prepend_bos=True
        ) == tl.get_token_position("the", PROMPT, mode=mode, prepend_bos=True)
    for query in ("dog", 7, torch.tensor(7), tokens[0], tokens):
        torch.testing.assert_close(
            bridge.tokens_to_residual_directions(query),
            tl.tokens_to_residual_directions(query),
            rtol=0,
            atol=0,
        )


def test_token_helper_errors(word_tokenizer):
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    with pytest.raises(ValueError, match=r"'the cat' is 2 tokens \['the', 'cat'\], not one"):
        bridge.to_single_token("the cat")
    with pytest.raises(ValueError, match="token 8 .'mat'. does not occur in the input"):
        bridge.get_token_position("mat", "the cat sat")
    with pytest.raises(ValueError, match="mode must be 'first' or 'last', got 'middle'"):
        bridge.get_token_position("cat", "the cat", mode="middle")
    with pytest.raises(ValueError, match=r"one sequence \[pos\] or \[1 pos\], got \(2, 2\)"):
        bridge.get_token_position(5, torch.ones(2, 2, dtype=torch.long))


def test_accumulated_bias_equals_transformer_lens(word_tokenizer):
    for arch in ("gpt2", "gpt_neox", "opt"):
        model = tiny_model(arch)
        bridge, tl = Bridge(model, word_tokenizer), tl_bridge(model, word_tokenizer)
        for layer in range(bridge.cfg.n_layers + 1):
            for mlp_input in (False, True) if layer < bridge.cfg.n_layers else (False,):
                for include in (False, True):
                    ours = bridge.accumulated_bias(layer, mlp_input, include)
                    theirs = tl.accumulated_bias(layer, mlp_input, include)
                    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    with pytest.raises(ValueError, match="mlp_input=True needs a layer below n_layers=2"):
        bridge.accumulated_bias(2, mlp_input=True)
    with pytest.raises(IndexError, match=r"layer must be in \[0, 2\], got 3"):
        bridge.accumulated_bias(3)
    moe = Bridge(tiny_model("mixtral"), word_tokenizer)
    assert not moe.accumulated_bias(2, include_mlp_biases=False).any()
    with pytest.raises(ValueError, match="layer 0 is a mixture-of-experts layer"):
        moe.accumulated_bias(1)


def test_loss_per_token_equals_transformer_lens(pair):
    bridge, tl = pair
    tokens = _tokens(tl)
    ours = bridge(tokens, return_type="loss", loss_per_token=True)
    assert ours.shape == (1, tokens.shape[1] - 1)
    torch.testing.assert_close(ours, tl(tokens, return_type="loss", loss_per_token=True), **FP32)
    torch.testing.assert_close(ours.mean(), bridge(tokens, return_type="loss"), **FP32)
    logits, loss = bridge(tokens, return_type="both", loss_per_token=True)
    torch.testing.assert_close(loss, ours, rtol=0, atol=0)


def test_loss_per_token_with_padding_matches_tl_formula(word_tokenizer):
    from transformer_lens.utilities.lm_utils import lm_cross_entropy_loss

    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    logits = bridge(tokens, attention_mask=mask)
    ours = bridge(tokens, return_type="loss", attention_mask=mask, loss_per_token=True)
    expected = lm_cross_entropy_loss(logits, tokens, mask, per_token=True)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)  # float() cast, same sums
    assert ours[1, 1:].eq(0).all() and ours[1, 0] > 0


def test_generate_keywords_decode_greedily_as_tl_forward(pair):
    """Greedy decoding, with and without the KV cache, picks TL's own argmax at every step.

    (TL 4.3's ``generate`` on these random-weight models does not follow its own forward's
    argmax, so the oracle is the definition: append ``argmax tl(x)[-1]`` four times.)
    """
    bridge, tl = pair
    expected = _tokens(tl)
    for _ in range(4):
        expected = torch.cat([expected, tl(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    for cache in (True, False):
        ours = bridge.generate(
            _tokens(tl), max_new_tokens=4, use_past_kv_cache=cache, stop_at_eos=False
        )
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_generate_stops_where_told(word_tokenizer, capsys):
    model = copy.deepcopy(tiny_model("llama"))
    bridge = Bridge(model, word_tokenizer)
    tokens = torch.tensor([[5, 6, 7]])
    free = bridge.generate(tokens, max_new_tokens=4, stop_at_eos=False)
    first = int(free[0, 3])
    assert bridge.generate(tokens, max_new_tokens=4, eos_token_id=first).shape[1] == 4
    model.generation_config.eos_token_id = first
    assert bridge.generate(tokens, max_new_tokens=4).shape[1] == 4
    assert torch.equal(bridge.generate(tokens, max_new_tokens=4, stop_at_eos=False), free)
    bridge.generate(tokens, max_new_tokens=4, stop_at_eos=False, verbose=True)
    assert "4/4" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match="freq_penalty .* is not supported; use repetition_penalty"
    ):
        bridge.generate(tokens, freq_penalty=1.0)
    with pytest.raises(ValueError, match="stop_at_eos=False never stops"):
        bridge.generate(tokens, stop_at_eos=False, eos_token_id=2)


def test_quantized_properties_refuse_outside_dequantized(word_tokenizer):
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    quantized = quantize(bridge, "int8", group_size=32)
    for name, what in [("W_Q", "read W_Q of layer 0"), ("OV", "read W_V of layer 0"),
                       ("W_out", "read W_out of layer 0")]:  # fmt: skip
        with pytest.raises(NotImplementedError, match=f"qlens cannot {what}"):
            getattr(quantized, name)
    with pytest.raises(NotImplementedError, match="qlens cannot read W_Q of layer 1"):
        _ = quantized.blocks[1].attn.W_Q
    with quantized.dequantized():
        for name in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out"):
            torch.testing.assert_close(
                getattr(quantized, name), getattr(bridge, name), atol=2e-3, rtol=0
            )  # int8 with group 32: |error| <= scale / 2 of weights ~N(0, 0.02)
        assert quantized.OV.shape == bridge.OV.shape
        assert quantized.accumulated_bias(2).shape == (64,)


def test_tokenization_defaults_are_settable_on_cfg(word_tokenizer):
    model = tiny_model("llama")
    bridge, tl = Bridge(model, word_tokenizer), tl_bridge(model, word_tokenizer)
    prompts = [PROMPT, "the cat sat"]
    for side in (bridge, tl):
        side.cfg.default_prepend_bos = False
        side.cfg.default_padding_side = "left"
    # TL 4.3's bridge pads on the tokenizer's side whatever its cfg says (HookedTransformer
    # read cfg.default_padding_side, as qlens does), so its side is passed explicitly
    ours, theirs = bridge.to_tokens(prompts), tl.to_tokens(prompts, padding_side="left")
    assert torch.equal(ours, theirs)
    assert ours[1, 0].item() == word_tokenizer.pad_token_id  # padded on the left, no BOS
    assert bridge.cfg.default_prepend_bos is False and bridge.cfg.default_padding_side == "left"


def test_cfg_switches_call_set_use(word_tokenizer):
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    bridge.cfg.use_attn_in = True
    assert bridge.cfg.use_attn_in is True
    _, cache = bridge.run_with_cache(
        torch.tensor([[1, 5, 6]]), names_filter="blocks.0.hook_attn_in"
    )
    assert cache["blocks.0.hook_attn_in"].shape == (1, 3, bridge.cfg.n_heads, bridge.cfg.d_model)
    with pytest.raises(ValueError, match="cannot both be on"):
        bridge.cfg.use_split_qkv_input = True
    with pytest.raises(TypeError, match="takes True or False"):
        bridge.cfg.use_attn_in = 1
    bridge.cfg.use_attn_in = False
    with pytest.raises(ValueError, match=r"set_use_attn_in\(True\)"):
        bridge.run_with_cache(torch.tensor([[1, 5, 6]]), names_filter="blocks.0.hook_attn_in")


def test_cfg_architecture_facts_are_read_only(word_tokenizer):
    cfg = Bridge(tiny_model("llama"), word_tokenizer).cfg
    with pytest.raises(AttributeError, match=r"cfg\.n_heads is a fact of the wrapped model.*"
                       r"default_prepend_bos, default_padding_side"):  # fmt: skip
        cfg.n_heads = 8
    with pytest.raises(AttributeError, match="cfg.dtype is a fact"):
        cfg.dtype = torch.float16
    with pytest.raises(AttributeError, match="no field 'n_head'"):
        cfg.n_head = 8
    with pytest.raises(ValueError, match="takes 'left' or 'right', got 'middle'"):
        cfg.default_padding_side = "middle"
    with pytest.raises(TypeError, match="takes True or False, got 0"):
        cfg.default_prepend_bos = 0
    assert cfg.n_heads == 4 and cfg.default_padding_side == "right"
