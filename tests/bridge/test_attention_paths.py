"""q/k/v/z hooks fire around the fast attention function; only scores/pattern compute them.

Both paths must give the same activations, the same logits as HF, and apply edits alike.
"""

from __future__ import annotations

import pytest
import torch
from bridge_models import ARCHS, tiny_model

from qlens.bridge import Bridge, attention

TOL = 1e-5
QKVZ = ("hook_q", "hook_k", "hook_rot_q", "hook_rot_k", "hook_v", "hook_z")
# llama/qwen2: GQA on SDPA; gpt2: MHA on SDPA; gemma2: its own eager function (soft-capping)
PATH_ARCHS = [a for a in ("llama", "qwen2", "gpt2", "gemma2") if a in ARCHS]


def _tokens() -> torch.Tensor:
    return torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(3))


def _mask() -> torch.Tensor:
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding on the second row
    return mask


def _count_explicit(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    explicit = attention._explicit_attention

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return explicit(*args, **kwargs)

    monkeypatch.setattr(attention, "_explicit_attention", counted)
    return calls


@pytest.mark.parametrize("arch", PATH_ARCHS)
def test_qkvz_on_fast_path_equal_explicit_path(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = Bridge(tiny_model(arch))
    tokens, mask = _tokens(), _mask()
    calls = _count_explicit(monkeypatch)
    with torch.no_grad():
        fast_logits, fast = bridge.run_with_cache(
            tokens, names_filter=lambda n: n.endswith(QKVZ), attention_mask=mask
        )
        fast_calls = calls[0]
        full_logits, full = bridge.run_with_cache(tokens, attention_mask=mask)
        expected = bridge.model(input_ids=tokens, attention_mask=mask).logits
    n_layers = bridge.cfg.n_layers
    assert fast_calls == 0
    assert calls[0] == fast_calls + n_layers  # scores/pattern requested: explicit everywhere
    per_layer = 6 if bridge.cfg.positional_embedding_type == "rotary" else 4
    assert len(fast) == per_layer * n_layers
    real = mask.bool()
    for name in fast:
        assert fast[name].shape == full[name].shape, name
        # padded query rows attend to nothing real; compare the real positions only
        assert (fast[name][real] - full[name][real]).abs().max() <= TOL, name
    assert (fast_logits - expected)[real].abs().max() <= TOL
    assert (full_logits - expected)[real].abs().max() <= TOL


def test_softcapping_under_sdpa_takes_the_explicit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA cannot soft-cap, so a Gemma 2 set to SDPA computes its scores explicitly."""
    import copy

    eager = tiny_model("gemma2")
    model = copy.deepcopy(eager)
    model.config._attn_implementation = "sdpa"
    assert model.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    bridge = Bridge(model)
    calls = _count_explicit(monkeypatch)
    tokens = _tokens()
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
        expected = eager(input_ids=tokens).logits
    assert calls[0] == bridge.cfg.n_layers
    assert (logits - expected).abs().max() <= TOL
    assert cache["blocks.0.attn.hook_z"].shape == (2, 9, bridge.cfg.n_heads, bridge.cfg.d_head)


@pytest.mark.parametrize("arch", [a for a in ("llama", "gpt2") if a in ARCHS])
def test_edits_of_q_and_z_act_the_same_on_both_paths(arch: str) -> None:
    bridge = Bridge(tiny_model(arch))
    tokens = _tokens()

    def zero_head_0(x: torch.Tensor, hook) -> torch.Tensor:  # noqa: ANN001
        x = x.clone()
        x[:, :, 0] = 0.0
        return x

    def keep(x: torch.Tensor, hook) -> None:  # noqa: ANN001
        return None

    edits = [
        ("blocks.0.attn.hook_q", zero_head_0),
        ("blocks.0.attn.hook_k", zero_head_0),
        ("blocks.1.attn.hook_z", zero_head_0),
    ]
    if bridge.cfg.positional_embedding_type == "rotary":
        edits.append(("blocks.1.attn.hook_rot_q", zero_head_0))
    force_explicit = [("blocks.0.attn.hook_pattern", keep), ("blocks.1.attn.hook_pattern", keep)]
    with torch.no_grad():
        clean = bridge(tokens)
        fast = bridge.run_with_hooks(tokens, fwd_hooks=edits)
        explicit = bridge.run_with_hooks(tokens, fwd_hooks=edits + force_explicit)
    assert (fast - clean).abs().max() > 1e-3  # the edits matter
    assert (fast - explicit).abs().max() <= TOL


def test_explicit_scores_mask_and_scale_match_a_direct_computation() -> None:
    """Scores = rotated q k^T * d_head^-0.5 per head (GQA: head h reads KV head h // group),
    masked with the dtype's minimum; the pattern is their softmax."""
    bridge = Bridge(tiny_model("llama"))
    tokens, mask = _tokens(), _mask()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens, attention_mask=mask)
    cfg = bridge.cfg
    group = cfg.n_heads // cfg.n_kv_heads
    q = cache["blocks.1.attn.hook_rot_q"]
    k = cache["blocks.1.attn.hook_rot_k"].repeat_interleave(group, dim=2)
    expected = torch.einsum("bqhd,bkhd->bhqk", q, k) * cfg.d_head**-0.5
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    scores = cache["blocks.1.attn.hook_attn_scores"]
    assert torch.all(scores[~allowed.expand_as(scores)] == torch.finfo(scores.dtype).min)
    assert (scores - expected)[allowed.expand_as(scores)].abs().max() <= TOL
    assert torch.allclose(cache["blocks.1.attn.hook_pattern"], torch.softmax(scores, -1), atol=TOL)


@pytest.mark.parametrize("arch", [a for a in ("llama", "gemma2") if a in ARCHS])
def test_masks_follow_the_fast_function(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SDPA an unpadded causal batch gets no mask (SDPA's fused causal kernels stay
    usable) and a padded one a boolean mask; an eager model keeps HF's additive float mask.
    Either way the hooked run reproduces HF's logits."""
    model = tiny_model(arch)
    bridge = Bridge(model)
    seen: list[tuple[str, torch.Tensor | None]] = []
    for name in ("sdpa_mask", "eager_mask"):
        original = getattr(attention, name)

        def spy(*args, _name=name, _original=original, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen.append((_name, _original(*args, **kwargs)))
            return seen[-1][1]

        monkeypatch.setattr(attention, name, spy)
    sdpa = model.config._attn_implementation == "sdpa"
    tokens, mask = _tokens(), _mask()
    with torch.no_grad():
        unpadded, _ = bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
        unpadded_seen = list(seen)
        padded, _ = bridge.run_with_cache(
            tokens, names_filter=lambda n: n.endswith("hook_z"), attention_mask=mask
        )
        expected = model(input_ids=tokens).logits
        expected_padded = model(input_ids=tokens, attention_mask=mask).logits
    assert unpadded_seen and len(seen) > len(unpadded_seen)
    if sdpa:
        assert all(kind == "sdpa_mask" and m is None for kind, m in unpadded_seen)
        padded_seen = seen[len(unpadded_seen) :]
        assert all(kind == "sdpa_mask" and m.dtype == torch.bool for kind, m in padded_seen)
    else:
        assert all(kind == "eager_mask" and m.is_floating_point() for kind, m in seen)
    assert (unpadded - expected).abs().max() <= TOL
    real = mask.bool()
    assert (padded - expected_padded)[real].abs().max() <= TOL
    assert model.config._attn_implementation == ("sdpa" if sdpa else "eager")
    assert not attention._SDPA_MASKED  # nothing left behind after the runs
