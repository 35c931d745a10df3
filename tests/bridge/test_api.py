"""Bridge API: name errors, hook lifetimes, editing, backward, generation, padding, stopping."""

from __future__ import annotations

import pytest
import torch
from bridge_models import tiny_model

from qlens.bridge import Bridge, attention
from qlens.bridge.names import OPT_IN_SUFFIXES

TOL = 1e-5
TOKENS = torch.tensor([[5, 17, 301, 42, 9, 77], [8, 600, 3, 250, 11, 99]])


def _no_torch_hooks(model: torch.nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
        for m in model.modules()
    )


def test_unknown_name_lists_close_names() -> None:
    bridge = Bridge(tiny_model("llama"))
    with pytest.raises(KeyError, match=r"closest valid names: blocks\.0\.hook_resid_pre"):
        bridge.add_hook("blocks.0.hook_resid_pr", lambda x, hook: None)
    with pytest.raises(KeyError, match=r"blocks\.1\.attn\.hook_pattern"):
        bridge.run_with_cache(TOKENS, names_filter=["blocks.1.attn.hook_patern"])
    # a name valid for other families but not this one
    with pytest.raises(
        KeyError, match="'hook_pos_embed'.*no learned position embedding.*hook_rot_q"
    ):
        bridge.add_hook("hook_pos_embed", lambda x, hook: None)
    neox = Bridge(tiny_model("gpt_neox"))
    assert "blocks.0.hook_resid_mid" not in neox.hook_names
    with pytest.raises(KeyError, match="unknown hook name 'blocks.0.hook_resid_mid'"):
        neox.add_hook("blocks.0.hook_resid_mid", lambda x, hook: None)


def test_names_filter_matching_nothing_raises() -> None:
    bridge = Bridge(tiny_model("llama"))
    with pytest.raises(ValueError, match="matched no hook name"):
        bridge.run_with_cache(TOKENS, names_filter=lambda name: "nothing" in name)
    with pytest.raises(ValueError, match="empty list"):
        bridge.run_with_cache(TOKENS, names_filter=[])
    with pytest.raises(ValueError, match="matched no hook name"):
        bridge.add_hook(lambda name: False, lambda x, hook: None)


def test_names_filter_forms() -> None:
    bridge = Bridge(tiny_model("gpt2"))
    _, cache = bridge.run_with_cache(TOKENS, names_filter="blocks.1.hook_resid_post")
    assert list(cache.keys()) == ["blocks.1.hook_resid_post"]
    _, cache = bridge.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_pattern"))
    assert list(cache.keys()) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    _, cache = bridge.run_with_cache(TOKENS)
    assert set(cache.keys()) == {n for n in bridge.hook_names if not n.endswith(OPT_IN_SUFFIXES)}
    assert "blocks.0.hook_mlp_in" in bridge.hook_names  # opt-in behind set_use_hook_mlp_in
    _, cache = bridge.run_with_cache(TOKENS, names_filter=lambda n: n.startswith("blocks.0."))
    assert "blocks.0.hook_mlp_in" not in cache and "blocks.0.attn.hook_result" in cache


@pytest.mark.parametrize("name", ["blocks.0.hook_resid_mid", "blocks.1.attn.hook_q"])
def test_wrong_shape_or_dtype_return_raises_naming_hook(name: str) -> None:
    bridge = Bridge(tiny_model("qwen2"))
    model = bridge.model
    with pytest.raises(ValueError, match=f"{name}.*same shape and dtype"):
        bridge.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, hook: x[..., :-1])])
    with pytest.raises(ValueError, match=f"{name}.*float64"):
        bridge.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, hook: x.double())])
    assert _no_torch_hooks(model)
    assert model.config._attn_implementation == "sdpa"


def test_exception_in_forward_removes_everything(arch: str) -> None:
    model = tiny_model(arch)
    bridge = Bridge(model)
    implementation = model.config._attn_implementation

    def boom(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with bridge.hooks(fwd_hooks=[(lambda n: True, lambda x, hook: None)]):
            bridge.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.attn.hook_pattern", boom)])
    assert _no_torch_hooks(model)
    assert model.config._attn_implementation == implementation
    assert not attention._TAPS
    assert not any(p.is_active for p in bridge.hook_dict.values())
    with torch.no_grad():
        assert torch.equal(bridge(TOKENS), model(TOKENS).logits)


def test_hooks_context_cleans_up_even_on_error() -> None:
    bridge = Bridge(tiny_model("llama"))
    seen = []
    with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: seen.append(1))]):
        assert bridge.hook_dict["blocks.0.hook_resid_post"].is_active
        bridge(TOKENS)
        bridge(TOKENS)
    assert seen == [1, 1]
    with pytest.raises(KeyError):
        with bridge.hooks(fwd_hooks=[("hook_embed", lambda x, hook: None), ("bad", print)]):
            pass
    assert not any(p.is_active for p in bridge.hook_dict.values())
    with pytest.raises(KeyError):  # run_with_hooks: the hook added before the bad one goes too
        bridge.run_with_hooks(TOKENS, fwd_hooks=[("hook_embed", lambda x, hook: None)],
                              bwd_hooks=[("bad", print)])  # fmt: skip
    assert not any(p.is_active for p in bridge.hook_dict.values())


def test_add_hook_persists_until_reset() -> None:
    bridge = Bridge(tiny_model("llama"))
    calls = []
    bridge.add_hook(
        lambda n: n.endswith("hook_resid_post"), lambda x, hook: calls.append(hook.name)
    )
    bridge(TOKENS)
    assert calls == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    bridge.reset_hooks()
    bridge(TOKENS)
    assert len(calls) == 2
    assert _no_torch_hooks(bridge.model)


def test_permanent_hooks_survive_reset_hooks_unless_asked() -> None:
    """TransformerLens' ``reset_hooks(including_permanent=...)``, ``add_perma_hook`` and
    ``add_hook(is_permanent=True)``: a plain reset keeps permanent hooks, which keep firing."""
    bridge = Bridge(tiny_model("llama"))
    calls: list[str] = []
    bridge.add_perma_hook("blocks.0.hook_resid_post", lambda x, hook: calls.append("perma"))
    bridge.add_hook("blocks.1.hook_resid_post", lambda x, hook: calls.append("fleeting"))
    bridge.reset_hooks()
    bridge(TOKENS)
    assert calls == ["perma"]
    bridge.add_hook("hook_embed", lambda x, hook: calls.append("bwd"), "bwd", is_permanent=True)
    bridge.reset_hooks(direction="fwd", including_permanent=True)
    assert (
        bridge.hook_dict["hook_embed"].bwd_hooks
        and not bridge.hook_dict["blocks.0.hook_resid_post"].is_active
    )
    bridge.reset_hooks(including_permanent=True)
    calls.clear()
    bridge(TOKENS)
    assert calls == [] and not any(p.is_active for p in bridge.hook_dict.values())
    assert _no_torch_hooks(bridge.model)


def test_editing_hooks_changes_the_forward() -> None:
    model = tiny_model("llama")
    bridge = Bridge(model)
    with torch.no_grad():
        clean = bridge(TOKENS)
        same = bridge.run_with_hooks(
            TOKENS,
            fwd_hooks=[
                (lambda n: n.startswith("blocks.0."), lambda x, hook: x.clone()),
            ],
        )
        assert (same - clean).abs().max() <= TOL
        # zeroing every head's z leaves o_proj with nothing: attn_out is exactly zero (no bias)
        _, cache = bridge.run_with_cache(TOKENS, names_filter="blocks.0.hook_attn_out")
        with bridge.hooks(
            fwd_hooks=[("blocks.0.attn.hook_z", lambda x, hook: torch.zeros_like(x))]
        ):
            ablated, cache2 = bridge.run_with_cache(TOKENS, names_filter="blocks.0.hook_attn_out")
        assert torch.all(cache2["blocks.0.hook_attn_out"] == 0)
        assert not torch.allclose(ablated, clean)


def test_resid_mid_edit_replaces_the_residual() -> None:
    bridge = Bridge(tiny_model("gemma2"))
    with torch.no_grad():
        with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_mid", lambda x, hook: x * 0 + 1)]):
            _, cache = bridge.run_with_cache(
                TOKENS, names_filter=lambda n: n.startswith("blocks.0")
            )
    assert torch.allclose(cache["blocks.0.hook_resid_mid"], torch.ones(1))
    expected = 1 + cache["blocks.0.ln2_post.hook_out"]
    assert (cache["blocks.0.hook_resid_post"] - expected).abs().max() <= TOL


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_scale_edit_rescales_normalized(arch: str) -> None:
    """Doubling the scale halves hook_normalized, and hook_out is it times weight plus bias."""
    bridge = Bridge(tiny_model(arch))
    ln = bridge.model.get_submodule(bridge.adapter.layers)[0].get_submodule(
        "ln_1" if arch == "gpt2" else "input_layernorm"
    )
    names = ["blocks.0.ln1.hook_normalized", "blocks.0.ln1.hook_out"]
    with torch.no_grad():
        _, clean = bridge.run_with_cache(TOKENS, names_filter=names)
        with bridge.hooks(fwd_hooks=[("blocks.0.ln1.hook_scale", lambda x, hook: x * 2)]):
            _, edited = bridge.run_with_cache(TOKENS, names_filter=names)
    normalized = edited["blocks.0.ln1.hook_normalized"]
    assert (normalized - clean["blocks.0.ln1.hook_normalized"] / 2).abs().max() <= TOL
    bias = ln.bias.detach() if arch == "gpt2" else 0.0
    expected_out = normalized * ln.weight.detach() + bias
    assert (edited["blocks.0.ln1.hook_out"] - expected_out).abs().max() <= TOL


def test_backward_hooks_receive_gradients() -> None:
    model = tiny_model("llama")
    bridge = Bridge(model)
    grads, acts = {}, {}

    def keep(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        x.retain_grad()
        acts[hook.name] = x

    name = "blocks.0.hook_resid_post"
    with bridge.hooks(
        fwd_hooks=[(name, keep)], bwd_hooks=[(name, lambda g, hook: grads.update({hook.name: g}))]
    ):
        bridge(TOKENS).logsumexp(-1).sum().backward()
    assert torch.equal(grads[name], acts[name].grad)
    assert grads[name].abs().sum() > 0
    model.zero_grad(set_to_none=True)
    # a backward hook can replace the gradient: zero it at the embedding, nothing flows back
    with bridge.hooks(bwd_hooks=[("hook_embed", lambda g, hook: torch.zeros_like(g))]):
        bridge(TOKENS).sum().backward()
    embed_grad = model.model.embed_tokens.weight.grad
    assert embed_grad is not None and torch.all(embed_grad == 0)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    assert _no_torch_hooks(model)


def test_generate_hooks_fire_and_steering_is_deterministic(word_tokenizer) -> None:  # noqa: ANN001
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    prompt = "the cat sat on the"
    base = bridge.generate(prompt, max_new_tokens=5, return_type="tokens")
    assert torch.equal(base, bridge.generate(prompt, max_new_tokens=5, return_type="tokens"))
    n_prompt = len(bridge.to_tokens(prompt)[0])
    assert base.shape == (1, n_prompt + 5)
    lengths = []
    steer = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 50
    hooks = [
        ("hook_embed", lambda x, hook: lengths.append(x.shape[1])),
        ("blocks.0.hook_resid_post", lambda x, hook: x + steer),
    ]
    with bridge.hooks(fwd_hooks=hooks):
        steered = bridge.generate(prompt, max_new_tokens=5, return_type="tokens")
        again = bridge.generate(prompt, max_new_tokens=5, return_type="tokens")
    assert lengths[:5] == [n_prompt, 1, 1, 1, 1]  # prefill, then one new token per step
    assert torch.equal(steered, again)
    assert torch.equal(steered[:, :n_prompt], base[:, :n_prompt])
    assert not torch.equal(steered, base)
    text = bridge.generate(prompt, max_new_tokens=2)
    assert isinstance(text, str) and text.startswith(prompt)
    assert _no_torch_hooks(bridge.model)


def test_generate_with_attention_hooks_matches_plain_generate(arch: str, word_tokenizer) -> None:  # noqa: ANN001
    bridge = Bridge(tiny_model(arch), word_tokenizer)
    prompts = ["the cat sat on the mat", "a dog"]
    base = bridge.generate(prompts, max_new_tokens=4, return_type="tokens")
    patterns = []
    hook = ("blocks.1.attn.hook_pattern", lambda x, hook: patterns.append(x.shape))
    with bridge.hooks(fwd_hooks=[hook]):
        hooked = bridge.generate(prompts, max_new_tokens=4, return_type="tokens")
    assert torch.equal(base, hooked)
    n = bridge.to_tokens(prompts).shape[-1]  # 6 words, and a BOS where the family takes one
    assert n == (7 if bridge.cfg.default_prepend_bos else 6)
    assert patterns[0][-2:] == (n, n)
    # decoding: one query reads the cached keys (a sliding-window cache keeps only the window)
    sliding_cache = arch in ("mistral", "gemma3_text")  # their layer 1 uses the window of 4
    assert patterns[1][-2:] == (1, 4 if sliding_cache else n + 1)
    assert bridge.model.config._attn_implementation != "qlens"


def test_generate_with_z_hooks_on_the_fast_path_matches_plain_generate(
    arch: str, word_tokenizer
) -> None:  # noqa: ANN001
    """hook_z keeps the model's own attention function (and, under SDPA, SDPA's masks: none for
    an unpadded prompt, boolean for a padded batch); prefill and cached decoding stay exact."""
    bridge = Bridge(tiny_model(arch), word_tokenizer)
    for prompts in ("the cat sat on the mat", ["the cat sat on the mat", "a dog"]):
        base = bridge.generate(prompts, max_new_tokens=4, return_type="tokens")
        shapes = []
        hook = ("blocks.1.attn.hook_z", lambda x, hook, seen=shapes: seen.append(x.shape))
        with bridge.hooks(fwd_hooks=[hook]):
            hooked = bridge.generate(prompts, max_new_tokens=4, return_type="tokens")
        assert torch.equal(base, hooked), prompts
        assert len(shapes) == 4 and shapes[1][1] == 1  # prefill, then one query per step
    assert bridge.model.config._attn_implementation != "qlens"


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_padded_batch_equals_single_runs(arch: str, padding_side: str, word_tokenizer) -> None:  # noqa: ANN001
    bridge = Bridge(tiny_model(arch), word_tokenizer)
    texts = ["the cat sat on the mat and ran", "a dog ran"]
    tokens = bridge.to_tokens(texts, padding_side=padding_side)
    mask = (tokens != word_tokenizer.pad_token_id).long()
    with torch.no_grad():
        batch_logits, cache = bridge.run_with_cache(
            tokens, attention_mask=mask, names_filter=lambda n: "pattern" in n
        )
        for row, text in enumerate(texts):
            single = bridge(text)
            real = mask[row].bool()
            assert (batch_logits[row, real] - single[0]).abs().max() <= TOL
    # padded keys get no attention from real queries
    pattern = cache["pattern", 0][1]
    real = mask[1].bool()
    assert torch.all(pattern[:, real][..., ~real] == 0)


def test_strings_build_the_mask_automatically(word_tokenizer) -> None:  # noqa: ANN001
    bridge = Bridge(tiny_model("gpt2"), word_tokenizer)
    with torch.no_grad():
        batch = bridge(["the cat sat on the mat", "a dog"])
        single = bridge("a dog")
    n = single.shape[1]  # "a dog" and the BOS GPT-2 takes by default
    assert n == 3
    assert (batch[1, :n] - single[0]).abs().max() <= TOL


def test_stop_at_layer(arch: str) -> None:
    bridge = Bridge(tiny_model(arch))
    n = bridge.cfg.n_layers
    with torch.no_grad():
        _, cache = bridge.run_with_cache(TOKENS, names_filter=lambda x: "resid" in x)
        resid_1 = bridge(TOKENS, stop_at_layer=1)
        resid_n = bridge(TOKENS, stop_at_layer=n)
        resid_neg = bridge(TOKENS, stop_at_layer=-1)
        resid_0, partial = bridge.run_with_cache(TOKENS, stop_at_layer=0, names_filter="hook_embed")
    n_layers = n
    assert torch.equal(resid_1, cache["resid_post", 0])
    assert torch.equal(resid_neg, cache["resid_pre", n - 1])
    assert torch.equal(resid_n, cache["resid_post", n - 1])
    assert torch.equal(resid_0, cache["resid_pre", 0]) and "hook_embed" in partial
    _, fireable = bridge.run_with_cache(TOKENS, stop_at_layer=1)  # no filter: what fires
    assert set(fireable) == {
        n
        for n in bridge.hook_names
        if n.startswith(("hook_", "blocks.0.")) and not n.endswith(OPT_IN_SUFFIXES)
    }
    _, to_last = bridge.run_with_cache(TOKENS, stop_at_layer=-1)
    assert not any(n.startswith((f"blocks.{n_layers - 1}.", "ln_final")) for n in to_last)
    with pytest.raises(ValueError, match=r"'blocks\.1\.hook_resid_pre' cannot fire"):
        bridge.run_with_cache(TOKENS, stop_at_layer=1, names_filter="blocks.1.hook_resid_pre")
    with pytest.raises(ValueError, match=r"'ln_final\.hook_normalized' cannot fire"):
        bridge.run_with_cache(TOKENS, stop_at_layer=n, names_filter="ln_final.hook_normalized")
    with pytest.raises(ValueError, match="stop_at_layer must be in"):
        bridge(TOKENS, stop_at_layer=n + 1)
    assert _no_torch_hooks(bridge.model)


def test_loss_matches_hf_and_return_types() -> None:
    model = tiny_model("mistral")
    bridge = Bridge(model)
    with torch.no_grad():
        expected = model(TOKENS, labels=TOKENS).loss
        logits, loss = bridge(TOKENS, return_type="both")
        assert abs(bridge(TOKENS, return_type="loss").item() - expected.item()) <= TOL
    assert torch.equal(loss, bridge(TOKENS, return_type="loss"))
    assert logits.shape == (2, 6, 1000)
    assert bridge(TOKENS, return_type=None) is None
    with pytest.raises((ValueError, TypeError), match="return_type"):
        bridge(TOKENS, return_type="probs")


def test_input_errors() -> None:
    bridge = Bridge(tiny_model("llama"))
    with pytest.raises(ValueError, match="no tokenizer"):
        bridge("hello")
    with pytest.raises(TypeError, match="int64/int32"):
        bridge(TOKENS.float())
    with pytest.raises(ValueError, match="attention_mask shape"):
        bridge(TOKENS, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"):
        bridge(TOKENS, attention_mask=torch.full_like(TOKENS, 2))
    bool_mask = torch.ones_like(TOKENS, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(
            bridge(TOKENS, attention_mask=bool_mask),
            bridge(TOKENS, attention_mask=bool_mask.long()),
        )


def test_tokens_helpers(word_tokenizer) -> None:  # noqa: ANN001
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    assert bridge.cfg.default_prepend_bos and bridge.cfg.default_padding_side == "right"
    assert bridge.to_tokens("the cat").tolist() == [[1, 4, 5]]
    assert bridge.to_tokens("the cat", prepend_bos=False).tolist() == [[4, 5]]
    left = bridge.to_tokens(["the cat", "a"], prepend_bos=False, padding_side="left")
    assert left.tolist() == [[4, 5], [0, 9]]
    assert bridge.to_tokens(["the cat", "a"]).tolist() == [[1, 4, 5], [1, 9, 0]]
    assert bridge.to_str_tokens("the cat sat") == ["<bos>", "the", "cat", "sat"]
    assert bridge.to_str_tokens("the cat sat", prepend_bos=False) == ["the", "cat", "sat"]
    assert bridge.to_str_tokens(["the cat", "a"]) == [["<bos>", "the", "cat"], ["<bos>", "a"]]
    assert bridge.to_str_tokens(torch.tensor([[4, 5], [9, 10]])) == [["the", "cat"], ["a", "dog"]]
    assert bridge.to_string(torch.tensor([4, 5])) == "the cat"
    assert bridge.to_string(torch.tensor([[4, 5], [9, 10]])) == ["the cat", "a dog"]


def test_running_the_bridge_inside_its_own_hook_is_refused() -> None:
    bridge = Bridge(tiny_model("llama"))

    def reenter(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        bridge(TOKENS)

    with pytest.raises(RuntimeError, match="already running"):
        bridge.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre", reenter)])
    assert _no_torch_hooks(bridge.model)
    with torch.no_grad():
        assert torch.equal(bridge(TOKENS), bridge.model(TOKENS).logits)


def test_run_with_hooks_can_keep_backward_hooks_for_a_later_backward() -> None:
    bridge = Bridge(tiny_model("phi3"))
    grads = []
    name = "blocks.1.mlp.hook_post"
    logits = bridge.run_with_hooks(
        TOKENS, bwd_hooks=[(name, lambda g, hook: grads.append(g.shape))], reset_hooks_end=False
    )
    logits.sum().backward()
    assert grads == [torch.Size([2, 6, 128])]
    bridge.reset_hooks()
    bridge.model.zero_grad(set_to_none=True)
    assert not bridge.hook_dict[name].is_active


def test_loss_ignores_padding_like_hf_ignore_index(word_tokenizer) -> None:  # noqa: ANN001
    model = tiny_model("llama")
    bridge = Bridge(model, word_tokenizer)
    texts = ["the cat sat on the mat", "a dog ran"]
    tokens = bridge.to_tokens(texts)
    mask = (tokens != word_tokenizer.pad_token_id).long()
    labels = tokens.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = model(tokens, attention_mask=mask, labels=labels).loss
        got = bridge(texts, return_type="loss")
    assert abs(got.item() - expected.item()) <= 1e-5
