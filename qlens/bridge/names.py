"""The canonical hook-name table and name resolution (exact names, filters, close matches)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

NamesFilter = str | Sequence[str] | Callable[[str], bool] | None

# A norm's RMS (or std) [batch pos 1], its input divided by it (before the weight), and its
# output (weight and bias applied), as TransformerLens names them.
LN_NAMES = ("hook_scale", "hook_normalized", "hook_out")
# q/k/v as projected (q/k before rotary and before any q/k norm), then q/k after rotary.
PROJECTION_NAMES = ("hook_q", "hook_k", "hook_v")
ROTARY_NAMES = ("hook_rot_q", "hook_rot_k")
ATTN_TAIL_NAMES = ("hook_attn_scores", "hook_pattern", "hook_z", "hook_result")
# Per-head copies of the residual feeding q/k/v (TransformerLens' split inputs), on separate
# q/k/v projections or a fused qkv of known layout; and the residual entering the MLP's norm.
SPLIT_INPUT_NAMES = ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input", "hook_attn_in")
MLP_IN_NAME = "hook_mlp_in"
# The two terms of an MoE block with a shared expert: the routed experts' weighted sum, and the
# shared expert's output scaled by its sigmoid gate; hook_mlp_out is their sum.
SHARED_EXPERT_NAMES = ("mlp.hook_routed_out", "mlp.hook_shared_expert_out")
# Opt-in names: only computed when asked for by name (not by names_filter=None), or by
# names_filter=None once their switch is on (see ``qlens.bridge.switches``).
OPT_IN_SUFFIXES = ("attn.hook_result", *SPLIT_INPUT_NAMES, MLP_IN_NAME)


@dataclass(frozen=True)
class LayerLayout:
    """Which optional components one decoder layer has; decides which names it can fire."""

    ln1_post: bool
    ln2_post: bool
    parallel: bool
    moe: bool
    gated: bool
    shared_expert: bool = False  # an MoE layer with a gated shared expert (Qwen2-MoE)
    rotary: bool = False
    split_inputs: bool = False  # q/k/v projections the per-head inputs can run through


def attention_hook_names(prefix: str, rotary: bool) -> list[str]:
    """The ``attn.*`` names of one layer, in firing order."""
    shorts = [*PROJECTION_NAMES, *(ROTARY_NAMES if rotary else ()), *ATTN_TAIL_NAMES]
    return [prefix + "attn." + n for n in shorts]


def layer_hook_names(i: int, layout: LayerLayout) -> list[str]:
    """Every canonical name of layer ``i``, in the order the forward fires them."""
    p = f"blocks.{i}."
    names = [p + "hook_resid_pre", *(p + "ln1." + n for n in LN_NAMES)]
    if layout.split_inputs:
        names += [p + n for n in SPLIT_INPUT_NAMES]
    names += attention_hook_names(p, layout.rotary)
    names.append(p + "hook_attn_out")
    if layout.ln1_post:
        names += [p + "ln1_post." + n for n in LN_NAMES]
    if not layout.parallel:
        names.append(p + "hook_resid_mid")
    names += [p + MLP_IN_NAME, *(p + "ln2." + n for n in LN_NAMES)]
    if layout.moe:
        names += [p + "mlp.hook_router_logits", p + "mlp.hook_router_weights"]
        if layout.shared_expert:
            names += [p + n for n in SHARED_EXPERT_NAMES]
    else:
        names.append(p + "mlp.hook_pre")
        if layout.gated:
            names.append(p + "mlp.hook_pre_linear")
        names.append(p + "mlp.hook_post")
    names.append(p + "hook_mlp_out")
    if layout.ln2_post:
        names += [p + "ln2_post." + n for n in LN_NAMES]
    names.append(p + "hook_resid_post")
    return names


def model_hook_names(layouts: Sequence[LayerLayout], learned_positions: bool) -> list[str]:
    names = ["hook_embed"] + (["hook_pos_embed"] if learned_positions else [])
    for i, layout in enumerate(layouts):
        names += layer_hook_names(i, layout)
    return names + ["ln_final." + n for n in LN_NAMES]


def layer_of(name: str) -> int | None:
    match = re.match(r"blocks\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def unknown_name_error(name: str, valid: Iterable[str]) -> KeyError:
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=5, cutoff=0.5)
    hint = f"closest valid names: {', '.join(close)}" if close else "no close match"
    if name == "hook_pos_embed":
        hint = (
            "it has no learned position embedding: rotary models see positions in attn.hook_rot_q"
        )
        hint += " and attn.hook_rot_k"
    return KeyError(
        f"unknown hook name {name!r} for this model ({hint}); "
        f"bridge.hook_names lists all {len(valid)} valid names"
    )


def resolve_names(names_filter: NamesFilter, valid: Sequence[str]) -> list[str]:
    """The valid names selected by a filter: None (all but opt-in), a name, a list, a callable."""
    valid_set = set(valid)
    if names_filter is None:
        return [n for n in valid if not n.endswith(OPT_IN_SUFFIXES)]
    if isinstance(names_filter, str):
        names_filter = [names_filter]
    if callable(names_filter):
        selected = [n for n in valid if names_filter(n)]
        if not selected:
            raise ValueError(
                "names_filter matched no hook name of this model; see bridge.hook_names "
                f"(e.g. {', '.join(valid[:3])}, ...)"
            )
        return selected
    selected = list(dict.fromkeys(names_filter))
    if not selected:
        raise ValueError("names_filter is an empty list; pass None to select every name")
    for name in selected:
        if not isinstance(name, str):
            raise TypeError(f"names_filter entries must be str, got {type(name).__name__}")
        if name not in valid_set:
            raise unknown_name_error(name, valid)
    return selected
