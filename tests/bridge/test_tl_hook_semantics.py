"""The hook names qlens shares with TransformerLens hold TransformerLens' values.

TransformerLens' own bridge wraps a copy of the same tiny HF model (fp32, random norm weights so
that normalized-before-weight and norm output differ), and both run the same tokens. The values
are computed by the same operations in both, so they agree to a few fp32 ulps.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import transformers as T
from bridge_models import tiny_model

from qlens.bridge import Bridge

transformer_lens = pytest.importorskip("transformer_lens")
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

TOL = 1e-5
ORACLE_ARCHS = ["llama", "qwen3"]  # qwen3: q/k norms between the projection and rotary
SHARED = (
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "ln1.hook_out",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "ln2.hook_out",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_z",
    "attn.hook_pattern",
)


def _model_with_random_norms(arch: str) -> torch.nn.Module:
    model = copy.deepcopy(tiny_model(arch))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
    return model.eval()


_PAIRS: dict[str, tuple[Bridge, TransformerBridge]] = {}


def pair(arch: str, tokenizer: T.PreTrainedTokenizerFast) -> tuple[Bridge, TransformerBridge]:
    """(qlens bridge, TransformerLens bridge) over two copies of one model, built once."""
    if arch not in _PAIRS:
        model = _model_with_random_norms(arch)
        config_dir = tempfile.mkdtemp()
        model.config.save_pretrained(config_dir)
        tokenizer.save_pretrained(config_dir)  # TransformerLens reloads it from its path
        saved_tokenizer = T.AutoTokenizer.from_pretrained(config_dir)
        tl = TransformerBridge.boot_transformers(
            config_dir, hf_model=copy.deepcopy(model), tokenizer=saved_tokenizer
        )
        _PAIRS[arch] = (Bridge(model, tokenizer), tl)
    return _PAIRS[arch]


def _tokens() -> torch.Tensor:
    return torch.randint(3, 1000, (2, 7), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
def test_shared_hook_names_hold_transformer_lens_values(arch: str, word_tokenizer) -> None:
    bridge, tl = pair(arch, word_tokenizer)
    tokens = _tokens()
    names = [f"blocks.{i}.{s}" for i in range(bridge.cfg.n_layers) for s in SHARED]
    names += ["ln_final.hook_scale", "ln_final.hook_normalized", "ln_final.hook_out"]
    with torch.no_grad():
        ours_logits, ours = bridge.run_with_cache(tokens, names_filter=names)
        tl_logits, theirs = tl.run_with_cache(tokens, names_filter=names)
    assert (ours_logits - tl_logits).abs().max() <= TOL
    for name in names:
        assert ours[name].shape == theirs[name].shape, name
        assert (ours[name] - theirs[name]).abs().max() <= TOL, name
    # the semantics the comparison rests on: they are different tensors
    assert (ours["blocks.0.attn.hook_q"] - ours["blocks.0.attn.hook_rot_q"]).abs().max() > 0.1
    normalized, out = ours["blocks.0.ln1.hook_normalized"], ours["blocks.0.ln1.hook_out"]
    assert (normalized - out).abs().max() > 0.1


def _zero_head(head: int):  # noqa: ANN202
    def edit(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
        x = x.clone()
        x[:, :, head] = 0.0
        return x

    return edit


def _halve(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
    return x * 0.5


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
@pytest.mark.parametrize(
    "hook",
    [
        ("blocks.0.attn.hook_q", _zero_head(1)),
        ("blocks.1.attn.hook_k", _zero_head(0)),
        ("blocks.0.attn.hook_rot_q", _zero_head(2)),
        ("blocks.1.attn.hook_rot_k", _zero_head(1)),
        ("blocks.0.attn.hook_v", _zero_head(1)),
        ("blocks.0.ln1.hook_normalized", _halve),
        ("blocks.1.ln2.hook_scale", _halve),
        ("blocks.0.ln2.hook_out", _halve),
    ],
    ids=lambda h: h[0],
)
def test_patching_changes_logits_as_in_transformer_lens(arch: str, hook, word_tokenizer) -> None:
    bridge, tl = pair(arch, word_tokenizer)
    tokens = _tokens()
    with torch.no_grad():
        clean = bridge(tokens)
        ours = bridge.run_with_hooks(tokens, fwd_hooks=[hook])
        theirs = tl.run_with_hooks(tokens, fwd_hooks=[hook])
    assert (ours - clean).abs().max() > 1e-3  # the edit matters
    assert (ours - theirs).abs().max() <= TOL


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
def test_grouped_query_attention_hooks_have_the_key_value_heads(arch: str, word_tokenizer) -> None:
    """On a GQA model (4 query heads, 2 key/value heads) hook_k, hook_rot_k and hook_v hold the
    key/value heads, as in TransformerLens 4.3; query head h reads key/value head
    h // (n_heads // n_kv_heads), so an edit of one key/value head reaches its group only."""
    bridge, tl = pair(arch, word_tokenizer)
    cfg = bridge.cfg
    assert (cfg.n_heads, cfg.n_kv_heads) == (4, 2)
    names = [f"blocks.0.attn.hook_{s}" for s in ("k", "rot_k", "v", "z")]
    tokens = _tokens()
    with torch.no_grad():
        _, ours = bridge.run_with_cache(tokens, names_filter=names)
        _, theirs = tl.run_with_cache(tokens, names_filter=names)
        with bridge.hooks(fwd_hooks=[("blocks.0.attn.hook_v", _zero_head(1))]):
            _, ablated = bridge.run_with_cache(tokens, names_filter=names[-1])
    for name in names:
        heads = cfg.n_heads if name.endswith("_z") else cfg.n_kv_heads
        assert ours[name].shape == theirs[name].shape == (2, 7, heads, cfg.d_head), name
        assert (ours[name] - theirs[name]).abs().max() <= TOL, name
    z, ablated_z = ours["blocks.0.attn.hook_z"], ablated["blocks.0.attn.hook_z"]
    assert torch.equal(ablated_z[:, :, :2], z[:, :, :2])  # group 0 reads key/value head 0
    assert torch.equal(ablated_z[:, :, 2:], torch.zeros_like(z[:, :, 2:]))
    assert z[:, :, 2:].abs().min() > 0


def test_projection_hooks_keep_the_fused_attention_kernel() -> None:
    """hook_q/hook_k on a rotary model fire on the projections: attention stays as it was."""
    bridge = Bridge(tiny_model("llama"))
    switched = []

    def record(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        switched.append(bridge.model.config._attn_implementation)

    names = ("blocks.0.attn.hook_q", "blocks.0.attn.hook_k")
    with torch.no_grad():
        bridge.run_with_hooks(_tokens(), fwd_hooks=[(n, record) for n in names])
    assert switched == ["sdpa", "sdpa"]


def test_rotary_names_exist_only_on_rotary_models() -> None:
    assert "blocks.0.attn.hook_rot_q" in Bridge(tiny_model("llama")).hook_names
    assert not any("hook_rot_" in n for n in Bridge(tiny_model("gpt2")).hook_names)


def test_fused_qkv_hook_q_edit_reaches_the_output() -> None:
    """GPT-NeoX's per-head fused qkv and Phi-3's block layout: hook_q/hook_k are the slices of
    the fused output, and an edit there equals the same edit after rotary at position 0."""
    for arch in ("gpt_neox", "phi3"):
        bridge = Bridge(tiny_model(arch))
        tokens = _tokens()[:, :1]  # one position: rotary is the identity
        with torch.no_grad():
            _, cache = bridge.run_with_cache(tokens, names_filter=lambda n: "attn.hook_" in n)
            for short in ("q", "k"):
                pre, rot = (
                    cache[f"blocks.0.attn.hook_{short}"],
                    cache[f"blocks.0.attn.hook_rot_{short}"],
                )
                assert (pre - rot).abs().max() <= TOL, (arch, short)
            pre_edit = bridge.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_k", _halve)])
            rot_edit = bridge.run_with_hooks(
                tokens, fwd_hooks=[("blocks.0.attn.hook_rot_k", _halve)]
            )
            v_edit = bridge.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_v", _halve)])
            clean = bridge(tokens)
        assert (pre_edit - rot_edit).abs().max() <= TOL, arch
        assert (v_edit - clean).abs().max() > 1e-4, arch  # v's slice is untouched by the site


@pytest.mark.parametrize("arch", ORACLE_ARCHS)  # llama takes a BOS by default, qwen3 does not
def test_strings_tokenize_as_in_transformer_lens(arch: str, word_tokenizer) -> None:
    bridge, tl = pair(arch, word_tokenizer)
    assert bridge.cfg.default_prepend_bos == tl.cfg.default_prepend_bos
    texts = ["the cat sat on the mat", "a dog"]
    for prepend_bos in (None, True, False):
        for side in ("left", "right"):
            ours = bridge.to_tokens(texts, prepend_bos=prepend_bos, padding_side=side)
            theirs = tl.to_tokens(texts, prepend_bos=prepend_bos, padding_side=side)
            assert torch.equal(ours, theirs), (prepend_bos, side)
        ours_str = bridge.to_str_tokens("a dog", prepend_bos=prepend_bos)
        assert ours_str == tl.to_str_tokens("a dog", prepend_bos=prepend_bos)
    with torch.no_grad():
        ours_logits = bridge("the cat sat")
        tl_logits = tl("the cat sat")
    assert ours_logits.shape == tl_logits.shape
    assert (ours_logits - tl_logits).abs().max() <= TOL


def test_a_tokenizer_that_adds_its_own_bos_gets_exactly_one(word_tokenizer) -> None:
    """A tokenizer that prepends BOS itself: no second BOS, and prepend_bos=False removes it."""
    from tokenizers import processors

    tokenizer = copy.deepcopy(word_tokenizer)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    assert tokenizer("the cat")["input_ids"] == [1, 4, 5]
    bridge = Bridge(tiny_model("llama"), tokenizer)
    assert bridge.to_tokens("the cat").tolist() == [[1, 4, 5]]
    assert bridge.to_tokens("the cat", prepend_bos=False).tolist() == [[4, 5]]
    qwen = Bridge(tiny_model("qwen3"), tokenizer)  # its default: no BOS
    assert qwen.to_tokens("the cat").tolist() == [[4, 5]]


def test_generate_returns_strings_without_the_prepended_bos(word_tokenizer) -> None:
    bridge = Bridge(tiny_model("llama"), word_tokenizer)
    tokens = bridge.generate("the cat", max_new_tokens=2, return_type="tokens")
    assert tokens[0, :3].tolist() == [1, 4, 5]
    text = bridge.generate("the cat", max_new_tokens=2)
    assert text == bridge.to_string(tokens[0, 1:])
    plain = bridge.generate("the cat", max_new_tokens=2, prepend_bos=False, return_type="tokens")
    assert plain[0, :2].tolist() == [4, 5]


def _from_previous_position(head: int):  # noqa: ANN202
    """Head ``head``'s copy takes the previous position's values (an edit norms cannot undo)."""

    def edit(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
        x = x.clone()
        x[:, :, head] = x.roll(1, dims=1)[:, :, head]
        return x

    return edit


# fused qkv: GPT-2's Conv1D [q|k|v], GPT-NeoX's per-head [q k v] blocks, Phi-3's [q|k|v] with GQA
SPLIT_ARCHS = [*ORACLE_ARCHS, "gpt2", "gpt_neox", "phi3"]


@pytest.mark.parametrize("arch", SPLIT_ARCHS)
@pytest.mark.parametrize(
    ("switch", "names", "edited"),
    [
        (
            "set_use_split_qkv_input",
            ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input"),
            "blocks.0.attn.hook_q_input",
        ),
        (
            "set_use_split_qkv_input",
            ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input"),
            "blocks.1.attn.hook_k_input",
        ),
        (
            "set_use_split_qkv_input",
            ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input"),
            "blocks.0.attn.hook_v_input",
        ),
        ("set_use_attn_in", ("hook_attn_in",), "blocks.1.hook_attn_in"),
        ("set_use_hook_mlp_in", ("hook_mlp_in",), "blocks.0.hook_mlp_in"),
    ],
)
def test_split_input_hooks_equal_transformer_lens(
    arch: str, switch: str, names: tuple[str, ...], edited: str, word_tokenizer
) -> None:
    """The per-head inputs hold TransformerLens' values; an edit of one head's copy gives
    TransformerLens' q/k/v (hook_q/hook_k/hook_v fire on what the edited copies produce) and
    logits."""
    bridge, tl = pair(arch, word_tokenizer)
    tokens = _tokens()
    n_layers = bridge.cfg.n_layers
    full = [f"blocks.{i}.{n}" for i in range(n_layers) for n in names]
    projections = [f"blocks.{i}.attn.hook_{s}" for i in range(n_layers) for s in "qkv"]
    with pytest.raises(ValueError, match=rf"fires only with bridge\.{switch}\(True\)"):
        bridge.run_with_cache(tokens, names_filter=full)
    getattr(bridge, switch)(True)
    getattr(tl, switch)(True)
    edit = [(edited, _from_previous_position(1))]
    try:
        with torch.no_grad():
            ours_logits, ours = bridge.run_with_cache(tokens)  # switched names are cached
            _, theirs = tl.run_with_cache(tokens, names_filter=full)
            with bridge.hooks(fwd_hooks=edit):
                patched, ours_patched = bridge.run_with_cache(tokens, names_filter=projections)
            with tl.hooks(fwd_hooks=edit):
                tl_patched, theirs_patched = tl.run_with_cache(tokens, names_filter=projections)
            clean = bridge(tokens)
    finally:
        getattr(bridge, switch)(False)
        getattr(tl, switch)(False)
    assert (ours_logits - clean).abs().max() <= TOL
    for name in full:
        assert ours[name].shape == theirs[name].shape, name
        assert (ours[name] - theirs[name]).abs().max() <= TOL, name
    for name in projections:
        assert (ours_patched[name] - theirs_patched[name]).abs().max() <= TOL, name
    assert (patched - clean).abs().max() > 1e-3
    assert (patched - tl_patched).abs().max() <= TOL


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_split_inputs_run_through_quantized_projections(arch: str) -> None:
    """The projection modules run per head, so int8 q/k/v or fused qkv projections serve the
    split path without reading a weight: unedited it gives the plain forward's logits, and an
    edit of one head's copy changes them."""
    import qlens

    float_bridge = Bridge(tiny_model(arch))
    bridge = qlens.quantize(float_bridge, "int8", skip=["lm_head", "*embed*", "*.mlp.*"])
    layer = bridge._layers[0].modules
    attention_inputs = ("q", "k", "v") if "q" in layer else ("qkv",)
    assert {type(layer[m]).__name__ for m in attention_inputs} == {"QuantLinear"}
    bridge.set_use_split_qkv_input(True)
    tokens = _tokens()
    with torch.no_grad():
        plain = bridge(tokens)
        _, cache = bridge.run_with_cache(tokens, names_filter="blocks.0.attn.hook_v_input")
        split = bridge.run_with_hooks(
            tokens, fwd_hooks=[("blocks.0.attn.hook_q_input", lambda x, hook: None)]
        )
        edited = bridge.run_with_hooks(
            tokens, fwd_hooks=[("blocks.0.attn.hook_k_input", _from_previous_position(0))]
        )
    resid = cache["blocks.0.attn.hook_v_input"]
    assert resid.shape == (2, 7, bridge.cfg.n_kv_heads, bridge.cfg.d_model)
    assert torch.equal(resid[:, :, 0], resid[:, :, 1])  # copies of one residual
    assert (split - plain).abs().max() <= 1e-4
    assert (edited - plain).abs().max() > 1e-3


def test_switches_are_checked() -> None:
    bridge = Bridge(tiny_model("llama"))
    bridge.set_use_split_qkv_input(True)
    with pytest.raises(ValueError, match="cannot both be on"):
        bridge.set_use_attn_in(True)
    _, cache = bridge.run_with_cache(_tokens())
    assert "blocks.1.attn.hook_q_input" in cache and "blocks.1.hook_attn_in" not in cache
    assert "blocks.0.attn.hook_result" not in cache
    bridge.set_use_attn_result(True)
    _, cache = bridge.run_with_cache(_tokens())
    assert "blocks.0.attn.hook_result" in cache


def test_norm_hooks_are_float32_on_a_bf16_model(word_tokenizer) -> None:
    """As in TransformerLens, hook_scale and hook_normalized stay float32 for bf16 models."""
    model = _model_with_random_norms("llama").to(torch.bfloat16)
    config_dir = tempfile.mkdtemp()
    model.config.save_pretrained(config_dir)
    word_tokenizer.save_pretrained(config_dir)
    tl = TransformerBridge.boot_transformers(
        config_dir,
        hf_model=copy.deepcopy(model),
        tokenizer=T.AutoTokenizer.from_pretrained(config_dir),
    )
    bridge = Bridge(model, word_tokenizer)
    names = [f"blocks.0.ln1.{s}" for s in ("hook_scale", "hook_normalized", "hook_out")]
    with torch.no_grad():
        _, ours = bridge.run_with_cache(_tokens(), names_filter=names)
        _, theirs = tl.run_with_cache(_tokens(), names_filter=names)
    for name in names:  # layer 0's norm reads the same bf16 embeddings: the same float32 ops
        assert ours[name].dtype == theirs[name].dtype, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
    assert ours[names[0]].dtype == ours[names[1]].dtype == torch.float32
    assert ours[names[2]].dtype == torch.bfloat16
    outputs = []  # the norm's output after a float32 edit, as TransformerLens rebuilds it

    def capture(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        outputs.append(x.clone())

    hooks = [(names[1], _halve), (names[2], capture)]
    with torch.no_grad():
        bridge.run_with_hooks(_tokens(), fwd_hooks=hooks, stop_at_layer=1)
        tl.run_with_hooks(_tokens(), fwd_hooks=hooks, stop_at_layer=1)
    assert outputs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert not torch.equal(outputs[0], ours[names[2]])
