"""Mixtral GGUF files: llama.cpp writes Mixtral as architecture ``llama`` with
``llama.expert_count`` > 0, each layer's experts stacked as ``blk.N.ffn_{gate,up,down}_exps``
(Mixtral's w1, w3, w2) and the router as ``blk.N.ffn_gate_inp``. transformers reads such a file
as a dense Llama; qlens builds a ``MixtralConfig`` from the same metadata (every field a Llama
file gives, plus ``num_local_experts`` = ``llama.expert_count`` and ``num_experts_per_tok`` =
``llama.expert_used_count``) and names the experts' tensors for ``MixtralExperts``' fused
``gate_up_proj`` (gate rows above up rows) and ``down_proj``. Files written before llama.cpp
stacked the experts hold one tensor per expert (``blk.N.ffn_gate.E.weight``...);
``qlens.gguf_per_expert`` gathers them into the same packed experts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qlens.gguf_metadata import int_field, text_field

EXPERT_COUNT, EXPERT_USED_COUNT = "llama.expert_count", "llama.expert_used_count"
# MixtralConfig's expert count and width (llama.expert_count, llama.feed_forward_length).
MIXTRAL_SIZE_NAMES = ("num_local_experts", "intermediate_size")
_GATE_UP = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.gate_up_proj")


def is_mixtral_file(reader: Any) -> bool:
    """Whether the file ``reader`` (a gguf-py ``GGUFReader``) reads is a Mixtral: architecture
    ``llama`` with experts."""
    architecture = text_field(reader, "general.architecture")
    return architecture == "llama" and (int_field(reader, EXPERT_COUNT) or 0) > 0


def is_mixtral_gguf(path: Path) -> bool:
    """Whether the GGUF file ``path`` holds a Mixtral (see ``is_mixtral_file``)."""
    from gguf import GGUFReader

    return is_mixtral_file(GGUFReader(str(path)))


def mixtral_config(path: Path, reader: Any) -> Any:
    """The ``MixtralConfig`` of a Mixtral file: the Llama fields transformers reads from its
    metadata, and the expert counts it does not read."""
    from transformers import MixtralConfig, PretrainedConfig

    experts = int_field(reader, EXPERT_COUNT)
    used = int_field(reader, EXPERT_USED_COUNT)
    if used is None or experts is None or not 0 < used <= experts:
        raise ValueError(
            f"{path.name} is a Mixtral file ({EXPERT_COUNT}={experts}) whose {EXPERT_USED_COUNT} "
            f"is {used}; it must name how many experts route each token, between 1 and "
            f"{EXPERT_COUNT}. The file's metadata is broken: convert the checkpoint again."
        )
    values, _ = PretrainedConfig.get_config_dict(str(path.parent), gguf_file=path.name)
    values = {key: value for key, value in values.items() if key != "model_type"}
    return MixtralConfig.from_dict(
        {**values, "num_local_experts": experts, "num_experts_per_tok": used}
    )


def mixtral_tensor_names(model: Any, processor: Any) -> dict[str, str]:
    """GGUF tensor name -> the Mixtral ``model``'s parameter: gguf-py's ``llama`` name map, with
    ``blk.N.ffn_gate_exps`` and ``ffn_up_exps`` both naming the fused ``gate_up_proj``."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    names: dict[str, str] = get_gguf_hf_weights_map(model, processor, model_type="llama")
    for key in model.state_dict():
        match = _GATE_UP.fullmatch(key)
        if match is not None:
            names[f"blk.{match['layer']}.ffn_gate_exps"] = key
            names[f"blk.{match['layer']}.ffn_up_exps"] = key
    return names
