"""Residual decompositions sum to the residual stream; their direct logit attribution sums to
the model's logit differences."""

from __future__ import annotations

import warnings

import pytest
import torch
from analysis_models import ARCHS, perturbed_model

from qlens import analysis
from qlens.bridge import Bridge
from qlens.weights import accessors as A

SANDWICH = ("gemma2", "gemma3_text")
TOL = dict(atol=5e-5, rtol=1e-5)
_RUNS: dict[str, tuple] = {}


def run(arch: str):
    if arch not in _RUNS:
        bridge = Bridge(perturbed_model(arch))
        tokens = torch.randint(3, 1000, (2, 5), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits, cache = bridge.run_with_cache(tokens)
        _RUNS[arch] = (bridge, cache, tokens, logits)
    return _RUNS[arch]


def _final_resid(bridge, cache):
    return cache[f"blocks.{bridge.cfg.n_layers - 1}.hook_resid_post"]


@pytest.mark.parametrize("arch", ARCHS)
def test_decompose_resid_sums_to_the_residual(arch):
    bridge, cache, _, _ = run(arch)
    full = analysis.decompose_resid(bridge, cache)
    n = bridge.cfg.n_layers
    assert full.labels["component"][-2:] == [f"{n - 1}_attn_out", f"{n - 1}_mlp_out"]
    assert full.axes == ("component", "batch", "pos", "d_model")
    torch.testing.assert_close(full.values.sum(0), _final_resid(bridge, cache), **TOL)
    partial = analysis.decompose_resid(bridge, cache, layer=1)
    torch.testing.assert_close(partial.values.sum(0), cache["blocks.1.hook_resid_pre"], **TOL)
    attn_only = analysis.decompose_resid(bridge, cache, mode="attn", incl_embeds=False)
    assert attn_only.labels["component"] == [f"{i}_attn_out" for i in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_head_results_plus_bias_are_the_attention_output(arch):
    bridge, cache, _, _ = run(arch)
    heads = analysis.stack_head_results(bridge, cache)
    n_heads = bridge.cfg.n_heads
    assert heads.labels["component"][n_heads] == "L1H0"
    for layer in range(bridge.cfg.n_layers):
        summed = heads.values[layer * n_heads : (layer + 1) * n_heads].sum(0)
        expected = cache[f"blocks.{layer}.hook_attn_out"]
        torch.testing.assert_close(summed + A.b_O(bridge, layer), expected, **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_decomposition_sums_to_the_residual(arch):
    bridge, cache, _, _ = run(arch)
    tol = dict(atol=1e-5, rtol=0) if arch in SANDWICH else TOL
    full = analysis.get_full_resid_decomposition(bridge, cache)
    torch.testing.assert_close(full.values.sum(0), _final_resid(bridge, cache), **tol)
    assert full.labels["component"][-1] == "bias"
    if bridge.cfg.n_experts:
        with pytest.raises(
            ValueError,
            match=r"\(expand_neurons\) are not defined for the mixture-of-experts layer 0",
        ):
            analysis.get_full_resid_decomposition(bridge, cache, expand_neurons=True)
        return
    neurons = analysis.get_full_resid_decomposition(bridge, cache, expand_neurons=True)
    assert "L1N3" in neurons.labels["component"]
    torch.testing.assert_close(neurons.values.sum(0), _final_resid(bridge, cache), **tol)


@pytest.mark.parametrize("arch", SANDWICH)
def test_sandwich_heads_go_through_the_post_norm_with_the_cached_scale(arch):
    bridge, cache, _, _ = run(arch)
    raw = analysis.stack_head_results(bridge, cache, 1).values  # layer 0, before the post norm
    normed = analysis.stack_head_results(bridge, cache, 1, apply_post_norm=True).values
    post = bridge.model.model.layers[0].post_attention_layernorm
    factor = (1 + post.weight.detach()) / cache["blocks.0.ln1_post.hook_scale"]
    torch.testing.assert_close(normed, raw * factor, atol=1e-6, rtol=1e-6)
    # The post norm of the summed heads is the attention's contribution to the residual.
    torch.testing.assert_close(
        normed.sum(0), cache["blocks.0.ln1_post.hook_out"], atol=1e-5, rtol=0
    )
    without_scale = {k: v for k, v in cache.items() if "ln1_post.hook_scale" not in k}
    with pytest.raises(ValueError, match=r"needs blocks\.0\.ln1_post\.hook_scale in the cache"):
        analysis.get_full_resid_decomposition(bridge, without_scale)


@pytest.mark.parametrize("arch", SANDWICH)
def test_sandwich_logit_attrs_reproduce_the_raw_logit_differences(arch):
    bridge, cache, tokens, logits = run(arch)
    decomposition = analysis.get_full_resid_decomposition(bridge, cache, expand_neurons=True)
    normalized = analysis.apply_ln_to_stack(bridge, cache, decomposition.values)
    correct, wrong = tokens.roll(-1, dims=1), torch.full_like(tokens, 7)
    attrs = analysis.logit_attrs(bridge, normalized, correct, wrong, allow_softcap=True)
    w_u = A.W_U(bridge)
    raw = cache["ln_final.hook_out"] @ w_u  # logits before any softcap
    expected = raw.gather(-1, correct[..., None])[..., 0] - raw[..., 7]
    torch.testing.assert_close(attrs.sum(0), expected, atol=2e-4, rtol=1e-4)
    softcap = bridge.cfg.final_logit_softcapping
    if softcap is None:  # Gemma 3: the raw logits are the model's logits
        model_diff = logits.gather(-1, correct[..., None])[..., 0] - logits[..., 7]
        torch.testing.assert_close(attrs.sum(0), model_diff, atol=2e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(softcap * torch.tanh(raw / softcap), logits, **TOL)


def test_logit_attrs_warn_on_softcapped_models():
    bridge, cache, tokens, _ = run("gemma2")
    stack = analysis.apply_ln_to_stack(
        bridge, cache, analysis.decompose_resid(bridge, cache).values
    )
    with pytest.warns(UserWarning, match=r"softcaps its final logits \(logits = 30\.0 \* tanh"):
        analysis.logit_attrs(bridge, stack, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        analysis.logit_attrs(bridge, stack, tokens, allow_softcap=True)
        gemma3, cache3, tokens3, _ = run("gemma3_text")  # no softcap: no warning
        stack3 = analysis.decompose_resid(gemma3, cache3).values
        analysis.logit_attrs(gemma3, stack3, tokens3)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma", "gpt_neox", "qwen3_moe", "qwen2_moe"])
def test_logit_attrs_reproduce_logit_differences(arch):
    bridge, cache, tokens, logits = run(arch)
    decomposition = analysis.get_full_resid_decomposition(bridge, cache)
    normalized = analysis.apply_ln_to_stack(bridge, cache, decomposition.values)
    ln_bias = getattr(bridge.ln_final, "bias", None)
    ln_bias = torch.zeros(bridge.cfg.d_model) if ln_bias is None else ln_bias.detach()
    torch.testing.assert_close(normalized.sum(0) + ln_bias, cache["ln_final.hook_out"], **TOL)
    with_bias = analysis.apply_ln_to_stack(bridge, cache, decomposition.values, bias_component=-1)
    torch.testing.assert_close(with_bias.sum(0), cache["ln_final.hook_out"], **TOL)
    torch.testing.assert_close(with_bias[:-1], normalized[:-1], atol=0, rtol=0)
    correct = tokens.roll(-1, dims=1)  # any per-position token ids
    wrong = torch.full_like(tokens, 7)
    attrs = analysis.logit_attrs(bridge, normalized, correct, wrong)
    assert attrs.shape == (len(decomposition.labels["component"]), *tokens.shape)
    w_u, b_u = A.W_U(bridge), A.b_U(bridge)
    constant = (w_u.T[correct] - w_u.T[wrong]) @ ln_bias + b_u[correct] - b_u[wrong]
    expected = logits.gather(-1, correct[..., None])[..., 0] - logits[..., 7]
    torch.testing.assert_close(attrs.sum(0) + constant, expected, atol=2e-4, rtol=1e-4)


def test_quantized_sandwich_decomposition_reads_weights_through_the_opt_in():
    from qlens.modules.model_quantize import quantize

    bridge = quantize(Bridge(perturbed_model("gemma2")), "int8", group_size=32)
    _, _, tokens, _ = run("gemma2")
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens)
    with pytest.raises(NotImplementedError, match=r"quantization: qlens int8 payload"):
        analysis.get_full_resid_decomposition(bridge, cache)
    full = analysis.get_full_resid_decomposition(bridge, cache, dequantize=True)
    torch.testing.assert_close(full.values.sum(0), _final_resid(bridge, cache), atol=1e-5, rtol=0)
