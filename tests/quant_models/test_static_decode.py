"""``qlens.StaticDecoder`` on the CPU: the tokens of transformers' greedy ``generate``, eager or
with the step compiled (the eager backends), for float, quantized and MoE models, batches with
left padding and end-of-sequence stops; bridge hooks fire in the compiled step and a change of
hooks picks the right graph."""

from __future__ import annotations

import pytest
import torch
from beartype.roar import BeartypeCallHintViolation
from jaxtyping import TypeCheckError
from tiny_models import CONFIGS, HIDDEN, VOCAB, input_ids, make_model
from torch._dynamo.utils import counters

from qlens.bridge import Bridge
from qlens.modules.model_quantize import quantize
from qlens.static_decode import StaticDecoder

STEPS = {"eager step": dict(compile=False), "compiled step": dict(backend="eager")}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = input_ids(seq=7, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("sync_every", [1, 4, 64])
def test_greedy_tokens_are_those_of_hf_generate(step: str, sync_every: int) -> None:
    model = make_model("llama")
    ids, mask = _padded_batch()
    reference = _hf_greedy(model, ids, mask, max_new_tokens=12, pad_token_id=0)
    decoder = StaticDecoder(model, 32, **STEPS[step])
    got = decoder.generate(ids, 12, attention_mask=mask, pad_token_id=0, sync_every=sync_every)
    assert torch.equal(got, reference)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_family_decodes_compiled_as_hf_generate_does(family: str) -> None:
    """Learned positions (GPT-2), sliding-window configs and attention sinks (GPT-OSS), and the
    MoE families, with a left-padded row; the second prompt (another length) runs compiled."""
    model = make_model(family)
    decoder = StaticDecoder(model, 16, backend="eager")
    for seq in (6, 9):
        ids = input_ids(seq=seq, batch=2, seed=seq)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        reference = _hf_greedy(model, ids, mask, max_new_tokens=6, pad_token_id=0)
        got = decoder.generate(ids, 6, attention_mask=mask, pad_token_id=0)
        assert torch.equal(got, reference), seq


@pytest.mark.parametrize(
    ("family", "scheme"),
    [("llama", None), ("llama", "int4"), ("gpt2", None), ("gpt_oss", None),
     ("mixtral", "int4"), ("qwen3_moe", "mxfp4")],
)  # fmt: skip
def test_one_compiled_prompt_serves_every_prompt_length(family: str, scheme: str | None) -> None:
    """The first call's prompt runs eagerly (it allocates the static cache); the next prompts,
    of any length from two tokens, contiguous or slices of a longer batch, run through one
    compiled graph, beside the step's."""
    model = make_model(family)
    if scheme is not None:
        model = quantize(model, scheme)
    decoder = StaticDecoder(model, 24, backend="eager")
    graphs: list[int] = []
    for seq in (5, 3, 9, 2, 12, 1):
        if seq in (9, 2):  # the last tokens of longer rows: strides of a 16-token batch
            ids = input_ids(seq=16, batch=2, seed=seq)[:, -seq:]
        else:
            ids = input_ids(seq=seq, batch=2, seed=seq)
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[0, : seq // 2] = 0  # left padding in one row
        reference = _hf_greedy(model, ids, mask, max_new_tokens=6, pad_token_id=0)
        got = decoder.generate(ids, 6, attention_mask=mask, pad_token_id=0)
        assert torch.equal(got, reference), seq
        graphs.append(counters["stats"]["unique_graphs"])
    # The step, then the prompt from the second call on; a one-token prompt runs eagerly.
    assert graphs == [1, 2, 2, 2, 2, 2]


def test_a_prompt_forward_that_does_not_compile_runs_eagerly_with_a_warning(caplog) -> None:
    """A hook that breaks the graph over prompts only: the step compiles, the prompt falls back
    to eager once, says so, and the tokens stay those of the bridge's own generate."""
    bridge = Bridge(make_model("llama"))

    def breaks_on_prompts(x: torch.Tensor, hook) -> torch.Tensor:
        if x.shape[1] > 1:
            torch._dynamo.graph_break()
        return x + 1.0

    ids = input_ids(seq=5, batch=1)
    decoder = StaticDecoder(bridge, 24, backend="eager")
    with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_post", breaks_on_prompts)]):
        expected = bridge.generate(ids, 4, stop_at_eos=False)
        with caplog.at_level("WARNING", logger="qlens.static_decode"):
            for _ in range(3):
                assert torch.equal(decoder.generate(ids, 4, stop_at_eos=False), expected)
    assert caplog.text.count("prompt forward does not compile") == 1
    assert "eager prompt" in repr(decoder)


def test_compile_prefill_false_runs_every_prompt_eagerly() -> None:
    model = make_model("llama")
    decoder = StaticDecoder(model, 24, backend="eager", compile_prefill=False)
    for seq in (5, 7):
        ids = input_ids(seq=seq, batch=1, seed=seq)
        reference = _hf_greedy(model, ids, torch.ones_like(ids), max_new_tokens=4, pad_token_id=0)
        assert torch.equal(decoder.generate(ids, 4, pad_token_id=0), reference)
    assert counters["stats"]["unique_graphs"] == 1
    assert "eager prompt" in repr(decoder)


@pytest.mark.parametrize("step", STEPS)
def test_rows_stop_at_their_end_of_sequence_ids_as_in_hf_generate(step: str) -> None:
    """Each row's first id of ``eos`` ends it (later tokens are the pad); the output stops after
    the step where the last row ended, whatever ``sync_every`` delays the host's check by."""
    model = make_model("llama")
    ids, mask = _padded_batch()
    free = _hf_greedy(model, ids, mask, max_new_tokens=12, pad_token_id=0)
    new = free[:, ids.shape[1] :]
    # End each row at a token it produces: every row ends before the 12 steps are up.
    eos = sorted({int(row[min(i + 2, 9)]) for i, row in enumerate(new)})
    reference = _hf_greedy(model, ids, mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
    assert reference.shape[1] < free.shape[1]  # the stop is exercised
    decoder = StaticDecoder(model, 32, **STEPS[step])
    for sync_every in (1, 5):
        got = decoder.generate(
            ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0, sync_every=sync_every
        )
        assert torch.equal(got, reference)
    unstopped = decoder.generate(ids, 12, attention_mask=mask, eos_token_id=eos, stop_at_eos=False)
    assert torch.equal(unstopped, free)


def test_end_of_sequence_defaults_to_the_generation_config() -> None:
    model = make_model("llama")
    ids, mask = _padded_batch()
    free = _hf_greedy(model, ids, mask, max_new_tokens=10, pad_token_id=0)
    model.generation_config.eos_token_id = int(free[0, ids.shape[1] + 1])
    reference = _hf_greedy(model, ids, mask, max_new_tokens=10, pad_token_id=0)
    got = StaticDecoder(model, 32, compile=False).generate(
        ids, 10, attention_mask=mask, pad_token_id=0
    )
    assert torch.equal(got, reference)


@pytest.mark.parametrize(
    ("family", "scheme"), [("llama", "int4"), ("llama", "nvfp4"), ("qwen3_moe", "mxfp4")]
)
def test_a_quantized_model_decodes_compiled_as_hf_generate_does(family: str, scheme: str) -> None:
    """The CPU runs the ops' torch reference in eager and compiled steps alike: equal tokens;
    the second and third prompts run through the compiled prompt graph."""
    model = quantize(make_model(family), scheme)
    decoder = StaticDecoder(model, 24, backend="eager")
    for seq in (6, 6, 11):
        ids = input_ids(seq=seq, batch=2)
        mask = torch.ones_like(ids)
        reference = _hf_greedy(model, ids, mask, max_new_tokens=8, pad_token_id=0)
        assert torch.equal(decoder.generate(ids, 8, pad_token_id=0), reference), seq


def test_bridge_hooks_fire_in_the_compiled_step_and_a_hook_change_picks_its_graph() -> None:
    bridge = quantize(Bridge(make_model("llama")), "int4")
    ids = input_ids(seq=6, batch=1)
    direction = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3))
    steering = [("blocks.0.hook_resid_post", lambda x, hook: x + 3 * direction)]
    with bridge.hooks(fwd_hooks=steering):
        steered = bridge.generate(ids, 10, stop_at_eos=False)
    plain = bridge.generate(ids, 10, stop_at_eos=False)
    assert not torch.equal(steered, plain)  # the hook changes the tokens

    decoder = StaticDecoder(bridge, 32, backend="eager")

    def decode(on: bool) -> torch.Tensor:
        with bridge.hooks(fwd_hooks=steering if on else []):
            return decoder.generate(ids, 10, stop_at_eos=False)

    for on in (True, False, True, False):  # graph reuse: test_compile_hook_guards.py
        assert torch.equal(decode(on), steered if on else plain)


def test_a_graph_traced_without_the_bridge_never_runs_its_hooks_away() -> None:
    """Two decoders share the step's code, so dynamo's cache: the step guards the names of the
    active hooks itself, even where dynamo does not guard empty hook dicts."""
    model = make_model("llama")
    bridge = Bridge(model)
    ids = input_ids(seq=5, batch=1)
    steering = [("blocks.0.hook_resid_post", lambda x, hook: x + 5.0)]
    with bridge.hooks(fwd_hooks=steering):
        steered = bridge.generate(ids, 6, stop_at_eos=False)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):  # dynamo's default
        plain = StaticDecoder(model, 16, backend="eager").generate(ids, 6, stop_at_eos=False)
        with bridge.hooks(fwd_hooks=steering):
            got = StaticDecoder(bridge, 16, backend="eager").generate(ids, 6, stop_at_eos=False)
    assert torch.equal(got, steered) and not torch.equal(got, plain)


def test_hooks_that_store_activations_see_every_token_with_the_eager_step() -> None:
    bridge = Bridge(make_model("llama"))
    ids = input_ids(seq=6, batch=1)
    seen: list[tuple[int, ...]] = []
    bridge.add_hook("blocks.1.hook_resid_post", lambda x, hook: seen.append(tuple(x.shape)))
    try:
        StaticDecoder(bridge, 16, compile=False).generate(ids, 4, stop_at_eos=False)
    finally:
        bridge.reset_hooks()
    assert seen == [(1, 6, HIDDEN)] + [(1, 1, HIDDEN)] * 3


def test_a_hook_that_raises_leaves_the_bridge_detached() -> None:
    bridge = Bridge(make_model("llama"))
    ids = input_ids(seq=4, batch=1)
    calls = []

    def fail_on_the_second_token(x: torch.Tensor, hook) -> torch.Tensor:
        calls.append(x.shape[1])
        if len(calls) == 2:
            raise ValueError("hook failed")
        return x

    decoder = StaticDecoder(bridge, 16, compile=False)
    with pytest.raises(ValueError, match="hook failed"):
        with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_post", fail_on_the_second_token)]):
            decoder.generate(ids, 4)
    assert calls == [4, 1]
    assert torch.equal(decoder.generate(ids, 4), bridge.generate(ids, 4))


def test_a_new_batch_size_and_a_reused_decoder_stay_exact() -> None:
    model = make_model("llama")
    decoder = StaticDecoder(model, 24, backend="eager")
    for batch in (2, 1, 2):
        ids = input_ids(seq=5, batch=batch, seed=batch)
        mask = torch.ones_like(ids)
        reference = _hf_greedy(model, ids, mask, max_new_tokens=6, pad_token_id=0)
        assert torch.equal(decoder.generate(ids, 6, pad_token_id=0), reference)


@pytest.mark.parametrize("step", STEPS)
def test_sampling_draws_among_the_top_k_and_top_k_one_is_greedy(step: str) -> None:
    """Compiled, each sampling setting is its own graph, and a call picks its own."""
    model = make_model("llama")
    ids = input_ids(seq=5, batch=2)
    decoder = StaticDecoder(model, 24, **STEPS[step])
    greedy = decoder.generate(ids, 8, stop_at_eos=False)
    assert torch.equal(decoder.generate(ids, 8, do_sample=True, top_k=1, stop_at_eos=False), greedy)
    torch.manual_seed(0)
    sampled = decoder.generate(ids, 8, do_sample=True, temperature=2.0, top_k=5, stop_at_eos=False)
    torch.manual_seed(0)
    again = decoder.generate(ids, 8, do_sample=True, temperature=2.0, top_k=5, stop_at_eos=False)
    assert torch.equal(sampled, again) and not torch.equal(sampled, greedy)
    with torch.no_grad():  # every drawn token is among the 5 most likely after its prefix
        logits = model(sampled[:, :-1]).logits[:, ids.shape[1] - 1 :]
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == sampled[:, ids.shape[1] :, None]).any(-1).all()


def test_bad_calls_are_refused_with_what_to_do() -> None:
    model = make_model("llama")
    decoder = StaticDecoder(model, 12, compile=False)
    ids = input_ids(seq=6, batch=1)
    with pytest.raises(ValueError, match=r"need a cache of 13, more than .*max_length=12"):
        decoder.generate(ids, 7)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        decoder.generate(ids, 0)
    # Refused by the decoder, or first by the tests' runtime type checker.
    with pytest.raises((ValueError, TypeCheckError, BeartypeCallHintViolation), match="input_ids"):
        decoder.generate(ids.float(), 2)
    with pytest.raises(
        (ValueError, TypeCheckError, BeartypeCallHintViolation), match="attention_mask"
    ):
        decoder.generate(ids, 2, attention_mask=torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="sync_every must be at least 1"):
        decoder.generate(ids, 2, sync_every=0)
    with pytest.raises(ValueError, match="temperature must be positive"):
        decoder.generate(ids, 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="at most 8 end-of-sequence ids"):
        decoder.generate(ids, 2, eos_token_id=list(range(9)))
    with pytest.raises(ValueError, match="pass compile=True"):
        StaticDecoder(model, 12, compile=False, backend="eager")
    with pytest.raises(ValueError, match="compile_prefill .* pass compile=True"):
        StaticDecoder(model, 12, compile=False, compile_prefill=True)
    with pytest.raises(ValueError, match=r"Linear does not declare support for a static KV cache"):
        StaticDecoder(torch.nn.Linear(VOCAB, VOCAB), 12)


RECORDED = [
    "blocks.0.hook_resid_post",
    "blocks.1.attn.hook_q",
    "blocks.0.attn.hook_pattern",
    "ln_final.hook_normalized",
]


@pytest.mark.parametrize("step", STEPS)
def test_recorded_activations_are_those_of_run_with_cache(step: str) -> None:
    """fp32: the static cache's attention over its masked empty slots adds zeros where
    ``run_with_cache`` attends over the sequence alone, a rounding difference of about 1e-7
    relative per op."""
    bridge = quantize(Bridge(make_model("llama")), "int4")
    ids, mask = _padded_batch()
    direction = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    steering = [("blocks.0.hook_mlp_out", lambda x, hook: x + direction)]
    decoder = StaticDecoder(bridge, 24, **STEPS[step])
    for _ in range(2):  # the second call reuses the buffers (and the compiled step)
        with bridge.hooks(fwd_hooks=steering):
            tokens, cache = decoder.generate_with_cache(
                ids, 6, RECORDED, attention_mask=mask, stop_at_eos=False
            )
            full_mask = torch.cat([mask, torch.ones(3, 5, dtype=torch.long)], dim=1)
            _, expected = bridge.run_with_cache(
                tokens[:, :-1], names_filter=RECORDED, attention_mask=full_mask
            )
        assert tokens.shape == (3, 13)
        real = full_mask.bool()  # left padding's positions hold whatever pads compute
        for name in RECORDED:
            got, want = cache[name], expected[name]
            assert got.shape == want.shape, name
            if name.endswith("hook_pattern"):
                got, want = got.transpose(1, 2), want.transpose(1, 2)  # [batch query ...]
            torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_recording_needs_a_bridge_and_known_names() -> None:
    model = make_model("llama")
    with pytest.raises(ValueError, match="recording activations needs hook points"):
        StaticDecoder(model, 16).generate_with_cache(input_ids(seq=4, batch=1), 2, RECORDED)
    decoder = StaticDecoder(Bridge(model), 16, compile=False)
    with pytest.raises(KeyError, match="blocks.9.hook_resid_post"):
        decoder.generate_with_cache(input_ids(seq=4, batch=1), 2, "blocks.9.hook_resid_post")


def test_the_repr_says_what_decodes_and_how() -> None:
    decoder = StaticDecoder(Bridge(make_model("llama")), 16, backend="eager")
    assert repr(decoder) == (
        "StaticDecoder(Bridge over LlamaForCausalLM, max_length=16, compiled step (eager), "
        "compiled prompt, no batch yet)"
    )
    decoder.generate(input_ids(seq=4, batch=2), 2)
    assert repr(decoder).endswith("batch 2)")
    eager = StaticDecoder(make_model("llama"), 16, compile=False)
    assert repr(eager) == "StaticDecoder(LlamaForCausalLM, max_length=16, eager step, no batch yet)"
