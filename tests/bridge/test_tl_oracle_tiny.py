"""TransformerLens 4.3 as the oracle on tiny random models of seven families, before and after
weight processing: hooks, weights and every ActivationCache analysis method.

Both sides run the same fp32 weights on the same tokens. The forwards are the same HF code, so
hooks agree exactly; analysis methods sum or contract over at most d_mlp = 128 terms in a
different order, so they agree to fp32 rounding (rtol 1e-5 on O(1) values, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from bridge_models import tiny_model
from tl_oracle import tl_bridge

from qlens import Bridge
from qlens.weights import accessors as A
from qlens.weights import process_weights

FAMILIES = ["llama", "gpt2", "qwen3", "gemma", "gemma2", "gpt_neox", "phi3"]
TOL = dict(rtol=1e-5, atol=1e-5)
TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 4, 5, 6], [1, 6, 6, 7, 8, 5, 4, 5, 6]])
PARALLEL_BLOCKS = {"gpt_neox"}  # no resid_mid: attention and MLP read the same residual
SANDWICH_NORMS = {"gemma2"}  # qlens routes each term through the post-norms; TL does not


class Pair:
    def __init__(self, arch: str, processed: bool, tokenizer) -> None:
        model = tiny_model(arch)
        self.arch = arch
        self.qlens = Bridge(model, tokenizer)
        self.tl = tl_bridge(model, tokenizer)
        if processed:
            self.qlens = process_weights(self.qlens).bridge
            self.tl.process_weights()
        self.logits, self.cache = self.qlens.run_with_cache(TOKENS)
        self.tl_logits, self.tl_cache = self.tl.run_with_cache(TOKENS)


@pytest.fixture(
    scope="module",
    params=[(a, p) for p in (False, True) for a in FAMILIES],
    ids=lambda p: f"{p[0]}-{'processed' if p[1] else 'raw'}",
)
def pair(request, word_tokenizer) -> Pair:
    arch, processed = request.param
    return Pair(arch, processed, word_tokenizer)


def _close(ours, theirs, tol=TOL):
    if isinstance(ours, tuple):
        assert ours[1] == theirs[1]
        ours, theirs = ours[0], theirs[0]
    torch.testing.assert_close(ours, theirs.to(ours.dtype), **tol)


def test_logits(pair):
    torch.testing.assert_close(pair.logits, pair.tl_logits, rtol=1e-5, atol=1e-5)


def test_shared_hooks(pair):
    shared = sorted(set(pair.cache.keys()) & set(pair.tl_cache.keys()))
    semantics_differ = {"hook_attn_scores"}  # masked entries: see the test below
    if (
        pair.arch in SANDWICH_NORMS
    ):  # qlens: the attention/MLP module's output, before the post-norm
        semantics_differ |= {"hook_attn_out", "hook_mlp_out"}
    compared = [n for n in shared if n.rsplit(".", 1)[-1] not in semantics_differ]
    assert len(compared) >= 20, compared
    for name in compared:
        theirs = pair.tl_cache[name]
        torch.testing.assert_close(pair.cache[name], theirs, **TOL, msg=name)


def test_pos_embed_has_the_batch_dim(pair):
    if "hook_pos_embed" not in pair.tl_cache:
        pytest.skip("rotary model: no learned position embedding")
    assert pair.cache["pos_embed"].shape == pair.tl_cache["pos_embed"].shape


def test_patching_one_row_of_pos_embed(pair):
    """The position embedding has a row per sequence: zeroing row 1 leaves row 0 untouched."""
    if "hook_pos_embed" not in pair.tl_cache:
        pytest.skip("rotary model: no learned position embedding")

    def zero_second_row(x, hook):  # out of place: TransformerLens' rows share memory
        return x * torch.tensor([1.0, 0.0]).view(2, 1, 1)

    hooks = [("hook_pos_embed", zero_second_row)]
    ours = pair.qlens.run_with_hooks(TOKENS, fwd_hooks=hooks)
    theirs = pair.tl.run_with_hooks(TOKENS, fwd_hooks=hooks)
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(ours[0], pair.logits[0], **TOL)
    assert not torch.allclose(ours[1], pair.logits[1])


def test_attention_scores_agree_where_unmasked(pair):
    """Masked scores: TransformerLens writes -inf, qlens the dtype's minimum (finite)."""
    for layer in range(pair.qlens.cfg.n_layers):
        ours = pair.cache["attn_scores", layer]
        theirs = pair.tl_cache["attn_scores", layer]
        masked = torch.isneginf(theirs)
        assert bool(masked.any())
        assert bool((ours[masked] == torch.finfo(ours.dtype).min).all())
        torch.testing.assert_close(ours[~masked], theirs[~masked], **TOL)


def test_queries_and_keys_before_and_after_rotary(pair):
    names = ["q", "k"] + (["rot_q", "rot_k"] if "blocks.0.attn.hook_rot_q" in pair.tl_cache else [])
    for name in names:
        for layer in range(pair.qlens.cfg.n_layers):
            _close(pair.cache[name, layer], pair.tl_cache[name, layer])


def _tl_block_part(pair: Pair, layer: int, name: str):
    block = pair.tl.blocks[layer]
    return block.attn if name[-1] in "QKVO" else block.mlp


def test_weights(pair):
    _close(A.W_E(pair.qlens), pair.tl.W_E)
    _close(A.W_U(pair.qlens), pair.tl.W_U)
    names = ["W_Q", "W_K", "W_V", "W_O", "W_in", "W_out"]
    for name in names + (["W_gate"] if pair.qlens.cfg.gated_mlp else []):
        for layer in range(pair.qlens.cfg.n_layers):
            theirs = getattr(_tl_block_part(pair, layer, name), name)
            _close(getattr(A, name)(pair.qlens, layer), theirs)


def test_biases(pair):
    for name in ["b_Q", "b_K", "b_V", "b_O", "b_in", "b_out"]:
        for layer in range(pair.qlens.cfg.n_layers):
            try:
                theirs = getattr(_tl_block_part(pair, layer, name), name)
            except AttributeError:  # TL: a bias-free projection has no such parameter
                theirs = None
            ours = getattr(A, name)(pair.qlens, layer)
            if theirs is None:
                assert not bool(ours.any()), f"{name}[{layer}]"
            else:
                _close(ours, theirs)


# (method, kwargs) run on both caches; ids name the case
CASES = [
    ("accumulated_resid", {}),
    ("accumulated_resid", dict(layer=1, incl_mid=True, return_labels=True)),
    ("accumulated_resid", dict(apply_ln=True, return_labels=True)),
    ("accumulated_resid", dict(layer=1, apply_ln=True)),
    ("accumulated_resid", dict(layer=1, mlp_input=True, apply_ln=True)),
    ("accumulated_resid", dict(pos_slice=-1, apply_ln=True)),
    ("accumulated_resid", dict(pos_slice=(2, 5), layer=1, apply_ln=True)),
    ("accumulated_resid", dict(pos_slice=[0, 3], layer=-1, incl_mid=True)),
    ("decompose_resid", dict(return_labels=True)),
    ("decompose_resid", dict(layer=1, mlp_input=True, return_labels=True)),
    ("decompose_resid", dict(mode="attn", apply_ln=True)),
    ("decompose_resid", dict(mode="mlp", incl_embeds=False, pos_slice=-1, apply_ln=True)),
    ("stack_head_results", dict(return_labels=True)),
    ("stack_head_results", dict(layer=1, incl_remainder=True, return_labels=True)),
    ("stack_head_results", dict(layer=0, incl_remainder=True)),
    ("stack_head_results", dict(apply_ln=True, pos_slice=-1)),
    ("stack_neuron_results", dict(layer=2, return_labels=True)),
    ("stack_neuron_results", dict(layer=1, neuron_slice=(0, 5), incl_remainder=True)),
    ("stack_neuron_results", dict(layer=1, neuron_slice=3, return_labels=True)),
    ("stack_neuron_results", dict(layer=2, apply_ln=True, pos_slice=-1)),
    ("stack_neuron_results", dict(layer=1, mlp_input=True, incl_remainder=True, apply_ln=True)),
    ("get_full_resid_decomposition", dict(return_labels=True)),
    ("get_full_resid_decomposition", dict(expand_neurons=False, apply_ln=True)),
    ("get_full_resid_decomposition", dict(layer=1, mlp_input=True, return_labels=True)),
    ("get_full_resid_decomposition", dict(pos_slice=-1, apply_ln=True, project_output_onto=0)),
    ("get_neuron_results", dict(layer=1, neuron_slice=[1, 4], pos_slice=2)),
    ("get_neuron_results", dict(layer=0, neuron_slice=7, project_output_onto=1)),
    ("stack_activation", dict(activation_name="pattern")),
    ("stack_activation", dict(activation_name="resid_post", layer=1)),
]


def _direction(index: int, d_model: int) -> torch.Tensor:
    return torch.randn(d_model, generator=torch.Generator().manual_seed(index))


@pytest.mark.parametrize(
    ("method", "kwargs"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)]
)
def test_cache_method(pair, method, kwargs):
    kwargs = dict(kwargs)
    if "project_output_onto" in kwargs:
        kwargs["project_output_onto"] = _direction(
            kwargs["project_output_onto"], pair.qlens.cfg.d_model
        )
    reads_mid = method in ("accumulated_resid", "stack_neuron_results")
    uses_mid = kwargs.get("incl_mid") or (kwargs.get("mlp_input") and reads_mid)
    if pair.arch in PARALLEL_BLOCKS and uses_mid:
        with pytest.raises(KeyError, match="resid_mid"):
            getattr(pair.cache, method)(**kwargs)
        return
    ours = getattr(pair.cache, method)(**kwargs)
    theirs = getattr(pair.tl_cache, method)(**kwargs)
    if pair.arch in SANDWICH_NORMS and method == "get_full_resid_decomposition":
        if kwargs.get("return_labels"):  # same components; values: see the test below
            assert ours[1] == theirs[1]
        return
    _close(ours, theirs)


def test_sandwich_norm_decomposition_sums_to_the_residual(word_tokenizer):
    """The deliberate difference: on Gemma 2 qlens passes each term through the post-norms
    (with their cached scale), so its components add up to the residual; TransformerLens' raw
    head/neuron outputs do not."""
    pair = Pair("gemma2", False, word_tokenizer)
    ours = pair.cache.get_full_resid_decomposition()
    theirs = pair.tl_cache.get_full_resid_decomposition()
    residual = pair.cache["resid_post", -1]
    torch.testing.assert_close(ours.sum(0), residual, rtol=1e-4, atol=1e-4)
    assert (theirs.sum(0) - residual).abs().max() > 0.1


LOGIT_CASES = [
    dict(tokens=torch.tensor([5, 7])),
    dict(tokens=torch.tensor([5, 7]), incorrect_tokens=torch.tensor([6, 6])),
    dict(tokens=4),
]


@pytest.mark.parametrize("kwargs", LOGIT_CASES, ids=["per-sequence", "difference", "one-token"])
def test_logit_attrs_at_the_last_position(pair, kwargs):
    ours = pair.cache.logit_attrs(
        pair.cache.decompose_resid(pos_slice=-1), pos_slice=-1, allow_softcap=True, **kwargs
    )
    theirs = pair.tl_cache.logit_attrs(
        pair.tl_cache.decompose_resid(pos_slice=-1), pos_slice=-1, **kwargs
    )
    _close(ours, theirs)


def test_logit_attrs_per_position(pair):
    kwargs = dict(tokens=TOKENS[:, 1:], incorrect_tokens=TOKENS[:, :-1], pos_slice=(0, -1))
    ours = pair.cache.logit_attrs(
        pair.cache.decompose_resid()[:, :, :-1], allow_softcap=True, **kwargs
    )
    theirs = pair.tl_cache.logit_attrs(pair.tl_cache.decompose_resid()[:, :, :-1], **kwargs)
    _close(ours, theirs)


def test_batch_slicing_and_head_results(pair):
    for rows in (1, (0, 1), [1, 0]):
        ours = pair.cache.apply_slice_to_batch_dim(rows)
        theirs = pair.tl_cache.apply_slice_to_batch_dim(rows)
        assert ours.has_batch_dim == theirs.has_batch_dim == (rows != 1)
        _close(ours["resid_post", -1], theirs["resid_post", -1])
        _close(ours.accumulated_resid(apply_ln=True), theirs.accumulated_resid(apply_ln=True))
        _close(
            ours.decompose_resid(layer=1, apply_ln=True),
            theirs.decompose_resid(layer=1, apply_ln=True),
        )
    ours, theirs = (
        pair.cache.apply_slice_to_batch_dim(None),
        pair.tl_cache.apply_slice_to_batch_dim(None),
    )
    ours.compute_head_results()
    theirs.compute_head_results()
    for layer in range(pair.qlens.cfg.n_layers):
        _close(ours["result", layer], theirs["result", layer])


def test_loss_fn_and_head_labels_answer_as_transformerlens(pair):
    """``loss_fn`` (mean, per token, with a mask that drops the last two positions of one
    row) and ``all_head_labels`` (TL 4's property, and a call as HookedTransformer had it)."""
    mask = torch.ones_like(TOKENS)
    mask[1, -2:] = 0
    for kwargs in ({}, {"per_token": True}, {"attention_mask": mask}):
        ours = pair.qlens.loss_fn(pair.logits, TOKENS, **kwargs)
        theirs = pair.tl.loss_fn(pair.tl_logits, TOKENS, **kwargs)
        torch.testing.assert_close(ours, theirs.to(ours.dtype), **TOL)
    assert list(pair.qlens.all_head_labels) == pair.tl.all_head_labels
    assert pair.qlens.all_head_labels() == pair.tl.all_head_labels
    assert pair.qlens.to_single_str_token(5) == pair.tl.to_single_str_token(5)


def test_backward_cache_gradients(pair):
    """``run_with_cache(incl_bwd=True)`` on the loss: TL's ``name_grad`` entries, to fp32
    rounding, except ``hook_resid_mid``'s (TL 4.3's differs from the loss's gradient there,
    which qlens gives: test_backward_cache checks it against finite differences) and, in
    Gemma 2, the branch outputs qlens routes through the post-norms."""
    ours = pair.qlens.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)[1]
    theirs = pair.tl.run_with_cache(TOKENS, return_type="loss", incl_bwd=True)[1]
    skipped = ("hook_resid_mid_grad",)
    if pair.arch in SANDWICH_NORMS:
        skipped += ("hook_attn_out_grad", "hook_mlp_out_grad")
    compared = [
        name
        for name in ours.keys()
        if name.endswith("_grad") and name in theirs.cache_dict and not name.endswith(skipped)
    ]
    assert len(compared) >= 30
    for name in compared:
        torch.testing.assert_close(ours[name], theirs[name].to(ours[name].dtype), **TOL)
    pair.qlens.zero_grad()
    pair.tl.zero_grad()
