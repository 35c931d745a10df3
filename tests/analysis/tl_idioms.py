"""TransformerLens idioms from its Main Demo and Exploratory Analysis Demo, each a function of
the model that returns what a notebook cell would look at. The same code runs on a
TransformerLens model and on a qlens bridge (tests/analysis/test_tl_idioms.py).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from transformer_lens import utilities as utils
from transformer_lens.head_detector import detect_head

PROMPT = "The Eiffel Tower is in the city of"
IOI = "When John and Mary went to the shops, John gave the bag to"
IOI_BATCH = [
    "When John and Mary went to the shops, John gave the bag to",
    "When Tom and James went to the park, James gave the ball to",
]
ANSWERS = [(" Mary", " John"), (" Tom", " James")]

IDIOMS: dict[str, Callable[[Any], Any]] = {}


def idiom(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    IDIOMS[fn.__name__] = fn
    return fn


# -- tokens ----------------------------------------------------------------------------------
@idiom
def to_tokens(model):
    return model.to_tokens(PROMPT)


@idiom
def to_tokens_without_bos(model):
    return model.to_tokens(PROMPT, prepend_bos=False)


@idiom
def to_tokens_batch(model):
    return model.to_tokens(IOI_BATCH)


@idiom
def to_str_tokens(model):
    return model.to_str_tokens(PROMPT)


@idiom
def to_str_tokens_of_tokens(model):
    return model.to_str_tokens(model.to_tokens(PROMPT))


@idiom
def to_str_tokens_of_a_list(model):
    return model.to_str_tokens(model.to_str_tokens(PROMPT, prepend_bos=False))


@idiom
def to_string(model):
    return model.to_string(model.to_tokens(PROMPT, prepend_bos=False)[0])


@idiom
def to_single_token(model):
    return model.to_single_token(" Paris")


@idiom
def get_token_position(model):
    return model.get_token_position(" Mary", IOI)


@idiom
def tokenizer_decode(model):
    return model.tokenizer.decode(model.to_tokens(PROMPT, prepend_bos=False)[0])


# -- config --------------------------------------------------------------------------------------
@idiom
def config_sizes(model):
    c = model.cfg
    return [c.n_layers, c.n_heads, c.d_model, c.d_head, c.d_mlp, c.d_vocab, c.n_ctx]


@idiom
def config_key_value_heads(model):
    return model.cfg.n_key_value_heads


@idiom
def config_default_prepend_bos(model):
    return model.cfg.default_prepend_bos


@idiom
def config_device(model):
    return str(model.cfg.device)


# -- forward ---------------------------------------------------------------------------------
@idiom
def logits_of_a_string(model):
    return model(PROMPT)


@idiom
def top_prediction(model):
    return model.to_string(model(PROMPT)[0, -1].argmax())


@idiom
def loss(model):
    return model(PROMPT, return_type="loss")


@idiom
def loss_per_token(model):
    return model(PROMPT, return_type="loss", loss_per_token=True)


@idiom
def logits_and_loss(model):
    return model(PROMPT, return_type="both")


@idiom
def forward_without_bos(model):
    return model(PROMPT, prepend_bos=False)


@idiom
def lm_cross_entropy_loss(model):
    tokens = model.to_tokens(PROMPT)
    return utils.lm_cross_entropy_loss(model(tokens), tokens)


@idiom
def stop_at_layer(model):
    return model(PROMPT, stop_at_layer=3)


# TransformerLens 4.3's KV-cached generation on SmolLM2 leaves its own greedy forward after a
# few tokens ("Paris----" where argmax of its forward gives "Paris, France."); its uncached
# loop is the reference.
@idiom
def greedy_generate(model):
    return model.generate(
        PROMPT, max_new_tokens=5, do_sample=False, verbose=False, use_past_kv_cache=False
    )


@idiom
def generate_tokens(model):
    tokens = model.to_tokens(PROMPT)
    return model.generate(
        tokens, max_new_tokens=4, do_sample=False, verbose=False, use_past_kv_cache=False
    )


# -- cache -----------------------------------------------------------------------------------
_SHARED_RUNS: dict[tuple[int, str], Any] = {}


def _cache(model, text=PROMPT, **kwargs):
    """``model.run_with_cache(text, **kwargs)[1]``; a plain run of a string is shared by the
    idioms that only read it (it is the slow part on CPU)."""
    if kwargs or not isinstance(text, str):
        return model.run_with_cache(text, **kwargs)[1]
    key = (id(model), text)
    if key not in _SHARED_RUNS:
        _SHARED_RUNS[key] = model.run_with_cache(text)[1]
    return _SHARED_RUNS[key]


@idiom
def cache_full_name(model):
    return _cache(model)["blocks.2.attn.hook_pattern"]


@idiom
def cache_pattern_shorthand(model):
    return _cache(model)["pattern", 2]


@idiom
def cache_pattern_with_sublayer(model):
    return _cache(model)["pattern", 2, "attn"]


@idiom
def cache_attn_alias(model):
    return _cache(model)["attn", 2]


@idiom
def cache_get_act_name(model):
    return _cache(model)[utils.get_act_name("resid_pre", 4)]


@idiom
def cache_negative_layer(model):
    return _cache(model)["resid_post", -1]


@idiom
def cache_compact_name(model):
    return _cache(model)["scale4ln1"]


@idiom
def cache_final_scale(model):
    return _cache(model)["ln_final.hook_scale"]


@idiom
def cache_values(model):
    return _cache(model)["v", 1]


@idiom
def cache_z(model):
    return _cache(model)["z", 5]


@idiom
def cache_mlp_post(model):
    return _cache(model)["post", 3]


@idiom
def cache_remove_batch_dim(model):
    return _cache(model, remove_batch_dim=True)["resid_mid", 0]


@idiom
def cache_method_remove_batch_dim(model):
    return model.run_with_cache(PROMPT)[1].remove_batch_dim()["embed"]


@idiom
def cache_names_filter(model):
    cache = _cache(model, names_filter=lambda name: name.endswith("hook_pattern"))
    return sorted(cache.keys())


@idiom
def cache_stop_at_layer(model):
    return _cache(model, stop_at_layer=3)["resid_pre", 2]


@idiom
def cache_to_cpu(model):
    return model.run_with_cache(PROMPT)[1].to("cpu")["mlp_out", 1]


@idiom
def cache_stack_activation(model):
    return _cache(model).stack_activation("resid_post")


@idiom
def cache_batch_slice(model):
    return _cache(model, IOI_BATCH).apply_slice_to_batch_dim(1)["resid_post", 5]


# -- the residual stream -------------------------------------------------------------------
@idiom
def accumulated_resid_logit_lens(model):
    cache = _cache(model)
    resid, labels = cache.accumulated_resid(
        layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True, return_labels=True
    )
    return resid @ model.W_U, labels


@idiom
def decompose_resid(model):
    return _cache(model).decompose_resid(layer=-1, pos_slice=-1, return_labels=True)


@idiom
def stack_head_results(model):
    return _cache(model).stack_head_results(layer=-1, pos_slice=-1, return_labels=True)


@idiom
def stack_neuron_results(model):
    return _cache(model).stack_neuron_results(layer=2, pos_slice=-1, neuron_slice=(0, 50))


@idiom
def full_resid_decomposition(model):
    return _cache(model).get_full_resid_decomposition(
        expand_neurons=False, pos_slice=-1, apply_ln=True, return_labels=True
    )


@idiom
def apply_ln_to_stack(model):
    cache = _cache(model)
    stack = cache.decompose_resid(layer=-1, pos_slice=-1)
    return cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)


@idiom
def tokens_to_residual_directions(model):
    answers = torch.tensor([[model.to_single_token(a) for a in pair] for pair in ANSWERS])
    directions = model.tokens_to_residual_directions(answers)
    return directions[:, 0] - directions[:, 1]


@idiom
def residual_stack_to_logit_diff(model):
    """Exploratory Analysis Demo: per-head logit difference through the cached final scale."""
    logits, cache = model.run_with_cache(IOI_BATCH)
    answers = torch.tensor([[model.to_single_token(a) for a in pair] for pair in ANSWERS])
    directions = model.tokens_to_residual_directions(answers)
    diff_directions = directions[:, 0] - directions[:, 1]
    per_head = cache.stack_head_results(layer=-1, pos_slice=-1)
    scaled = cache.apply_ln_to_stack(per_head, layer=-1, pos_slice=-1)
    return torch.einsum("cbd,bd->c", scaled, diff_directions) / len(IOI_BATCH)


@idiom
def logit_attrs(model):
    cache = _cache(model, IOI)
    stack, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    return cache.logit_attrs(stack, " Mary", " John", pos_slice=-1), labels


@idiom
def logit_attrs_to_tokens(model):
    cache = _cache(model, IOI)
    stack = cache.accumulated_resid(pos_slice=-1)
    token = torch.tensor([model.to_single_token(" Mary")])
    return cache.logit_attrs(stack, token, pos_slice=-1)


@idiom
def compute_head_results(model):
    cache = model.run_with_cache(PROMPT)[1]
    cache.compute_head_results()
    return cache["result", 4]


@idiom
def neuron_results_projected(model):
    direction = model.W_U[:, model.to_single_token(" Paris")]
    return _cache(model).get_neuron_results(3, pos_slice=-1, project_output_onto=direction)


@idiom
def accumulated_bias(model):
    return model.accumulated_bias(5)


# -- hooks -------------------------------------------------------------------------------------
@idiom
def ablate_a_head(model):
    # SmolLM2 has 3 key/value heads for its 9 query heads: hook_v is [batch pos 3 d_head], so
    # zeroing value head 2 ablates query heads 6-8, which read it
    def zero_head(value, hook):
        value[:, :, 2] = 0.0
        return value

    return model.run_with_hooks(
        PROMPT, return_type="loss", fwd_hooks=[(utils.get_act_name("v", 0), zero_head)]
    )


@idiom
def hook_with_a_filter(model):
    seen = []

    def record(pattern, hook):
        seen.append((hook.name, hook.layer(), pattern.shape))

    model.run_with_hooks(PROMPT, fwd_hooks=[(lambda name: name.endswith("pattern"), record)])
    return seen


@idiom
def patch_from_a_clean_cache(model):
    _, clean = model.run_with_cache(IOI_BATCH[0])

    def patch_head(z, hook, head=2):
        z[:, :, head] = clean[hook.name][:, :, head]
        return z

    fwd = [(utils.get_act_name("z", layer), partial(patch_head)) for layer in (3, 5)]
    return model.run_with_hooks(IOI_BATCH[1], fwd_hooks=fwd)[0, -1]


@idiom
def mean_ablate_mlp(model):
    def mean_ablate(out, hook):
        return out.mean(1, keepdim=True).expand_as(out)

    return model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.4.hook_mlp_out", mean_ablate)])


@idiom
def add_hook_then_reset(model):
    def double(resid, hook):
        return resid * 2

    model.add_hook("blocks.1.hook_resid_pre", double)
    try:
        hooked = model(PROMPT)
    finally:
        model.reset_hooks()
    return hooked, model(PROMPT)


@idiom
def hooks_context(model):
    def scale(x, hook):
        return x * 0.5

    with model.hooks(fwd_hooks=[("blocks.0.hook_attn_out", scale)]):
        return model(PROMPT)


@idiom
def hook_dict_holds_the_names(model):
    return [
        "blocks.0.attn.hook_pattern" in model.hook_dict,
        "blocks.0.hook_resid_pre" in model.hook_dict,
    ]


@idiom
def mod_dict_hook_point(model):
    point = model.mod_dict["blocks.3.hook_resid_post"]
    return point is model.hook_dict["blocks.3.hook_resid_post"], point.layer()


@idiom
def blocks_hook_point(model):
    return model.blocks[2].attn.hook_pattern.name


@idiom
def use_attn_result(model):
    model.set_use_attn_result(True)
    try:
        return model.run_with_cache(PROMPT)[1]["result", 1]
    finally:
        model.set_use_attn_result(False)


@idiom
def induction_scores(model):
    """Main Demo: the mean attention on the induction stripe of repeated random tokens."""
    seq_len = 20
    torch.manual_seed(0)
    half = torch.randint(1000, 10000, (1, seq_len))
    tokens = torch.cat([torch.tensor([[model.tokenizer.bos_token_id]]), half, half], dim=1)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("pattern"))
    scores = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)
    for layer in range(model.cfg.n_layers):
        stripe = cache["pattern", layer].diagonal(-seq_len + 1, dim1=-2, dim2=-1)
        scores[layer] = stripe[0, :, 1:].mean(-1)
    return scores


# -- weights -----------------------------------------------------------------------------------
@idiom
def embedding_weights(model):
    return model.W_E[:100], model.W_U[:, :100]


@idiom
def stacked_attention_weights(model):
    return model.W_Q[2], model.W_K[2], model.W_V[2], model.W_O[2]


@idiom
def block_weights(model):
    return model.blocks[4].attn.W_Q, model.blocks[4].mlp.W_out


@idiom
def ov_circuit(model):
    return model.OV[1, 3].AB


@idiom
def qk_circuit_norm(model):
    return model.QK[2, 0].norm()


@idiom
def direct_unembed_of_a_token(model):
    return model.W_E[model.to_single_token(" Paris")] @ model.W_U[:, :50]


@idiom
def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


@idiom
def eval_mode(model):
    return model.eval() is model, model.training


# -- TransformerLens' own tools on the model -------------------------------------------------
@idiom
def detect_previous_token_heads(model):
    return detect_head(
        model, "The cat sat on the mat. The cat sat on the mat.", "previous_token_head"
    )


@idiom
def detect_induction_heads(model):
    return detect_head(model, "The cat sat on the mat. The cat sat on the mat.", "induction_head")


@idiom
def test_prompt(model):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        utils.test_prompt("The capital of France is", "Paris", model, top_k=5)
    return printed.getvalue()
