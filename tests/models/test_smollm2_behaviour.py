"""The embedded SmolLM2 model behaves like the real model, and the bridge's edits are exact."""

from __future__ import annotations

import pytest
import torch

from qlens.models import default_model_cache_dir

pytestmark = pytest.mark.slow

IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPT = "When John and Mary went to the store, Mary gave a drink to"


def _token_id(bridge, text: str) -> int:
    ids = bridge.to_tokens(text, prepend_bos=False)
    assert ids.shape == (1, 1), f"{text!r} is not a single token"
    return int(ids[0, 0])


def test_default_model_is_smollm2_in_float32_from_the_cache(smollm2):
    assert smollm2.model.name_or_path == str(default_model_cache_dir())
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert smollm2.cfg.n_layers == 30
    assert {p.dtype for p in smollm2.model.parameters()} == {torch.float32}


def test_greedy_next_token_is_paris(smollm2):
    tokens = smollm2.to_tokens("The capital of France is")
    with torch.no_grad():
        logits = smollm2(tokens)
        plain = smollm2.model(tokens).logits
    assert smollm2.to_string(logits[0, -1].argmax().reshape(1)) == " Paris"
    assert torch.equal(logits, plain)


def test_ioi_logit_difference_favours_the_indirect_object(smollm2):
    with torch.no_grad():
        logits = smollm2(IOI_CLEAN)
    mary, john = _token_id(smollm2, " Mary"), _token_id(smollm2, " John")
    assert float(logits[0, -1, mary] - logits[0, -1, john]) > 3.0


@pytest.fixture(scope="module")
def ioi_runs(smollm2):
    clean = smollm2.to_tokens(IOI_CLEAN)
    corrupt = smollm2.to_tokens(IOI_CORRUPT)
    assert clean.shape == corrupt.shape
    with torch.no_grad():
        clean_logits, clean_cache = smollm2.run_with_cache(
            clean, names_filter=lambda name: name.endswith("hook_resid_pre")
        )
        corrupt_logits = smollm2(corrupt)
    assert not torch.allclose(clean_logits, corrupt_logits, atol=1e-2)
    return corrupt, clean_logits, clean_cache


def _patch_from(cache):
    def patch(resid, hook):
        return cache[hook.name]

    return patch


def test_patching_every_layers_resid_pre_restores_the_clean_logits(smollm2, ioi_runs):
    corrupt, clean_logits, clean_cache = ioi_runs
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(smollm2.cfg.n_layers)]
    assert sorted(clean_cache.keys()) == sorted(names)
    with torch.no_grad():
        patched = smollm2.run_with_hooks(
            corrupt, fwd_hooks=[(name, _patch_from(clean_cache)) for name in names]
        )
    assert torch.equal(patched, clean_logits)


def test_patching_one_layers_resid_pre_restores_the_clean_logits(smollm2, ioi_runs):
    corrupt, clean_logits, clean_cache = ioi_runs
    with torch.no_grad():
        for layer in (0, 14, smollm2.cfg.n_layers - 1):
            name = f"blocks.{layer}.hook_resid_pre"
            patched = smollm2.run_with_hooks(corrupt, fwd_hooks=[(name, _patch_from(clean_cache))])
            assert torch.equal(patched, clean_logits), name


def test_zeroing_one_heads_z_changes_only_that_heads_share_of_the_output(smollm2):
    layer, head = 9, 3
    prefix = f"blocks.{layer}.attn."
    tokens = smollm2.to_tokens(IOI_CLEAN)

    def ablate(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    names = [prefix + "hook_z", f"blocks.{layer}.hook_attn_out"]
    with torch.no_grad():
        clean_logits, clean = smollm2.run_with_cache(tokens, names_filter=names)
        with smollm2.hooks(fwd_hooks=[(prefix + "hook_z", ablate)]):
            ablated_logits, ablated = smollm2.run_with_cache(tokens, names_filter=names)
    assert ablated[prefix + "hook_z"][:, :, head].abs().max() == 0
    assert torch.equal(
        torch.cat(
            [ablated[prefix + "hook_z"][:, :, :head], ablated[prefix + "hook_z"][:, :, head + 1 :]],
            2,
        ),
        torch.cat(
            [clean[prefix + "hook_z"][:, :, :head], clean[prefix + "hook_z"][:, :, head + 1 :]], 2
        ),
    )
    # The attention output moves by exactly the head's contribution through o_proj.
    o_proj = smollm2.model.model.layers[layer].self_attn.o_proj.weight
    d_head = smollm2.cfg.d_head
    head_z = clean[prefix + "hook_z"][:, :, head]
    contribution = head_z @ o_proj[:, head * d_head : (head + 1) * d_head].T
    moved = clean[f"blocks.{layer}.hook_attn_out"] - ablated[f"blocks.{layer}.hook_attn_out"]
    torch.testing.assert_close(moved, contribution, rtol=1e-4, atol=1e-4)
    assert (ablated_logits - clean_logits).abs().max() > 1e-3


def test_the_static_decoder_takes_strings_as_the_bridge_generate_does(smollm2):
    from qlens import StaticDecoder

    prompts = ["The capital of France is", "Hi"]  # left-padded to one batch
    decoder = StaticDecoder(smollm2, 32, compile=False)
    tokens = decoder.generate(prompts, 5)
    expected = smollm2.generate(prompts, 5, return_type="tokens")
    assert torch.equal(tokens, expected)
    assert smollm2.to_string(tokens[0, -5:]).startswith(" Paris")
    assert torch.equal(
        decoder.generate(prompts[0], 5), smollm2.generate(prompts[0], 5, return_type="tokens")
    )
    _, cache = decoder.generate_with_cache(prompts, 3, "blocks.0.hook_resid_post")
    assert cache["blocks.0.hook_resid_post"].shape[:2] == (2, tokens.shape[1] - 5 + 2)
    with pytest.raises(TypeError, match="strings need a Bridge's tokenizer"):
        StaticDecoder(smollm2.model, 32, compile=False).generate(prompts, 5)
