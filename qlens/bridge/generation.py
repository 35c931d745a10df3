"""TransformerLens ``generate`` keywords, translated into Hugging Face ``generate`` arguments."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class ProgressBar(LogitsProcessor):
    """Advances a tqdm bar once per generated token (``verbose=True``); scores pass unchanged."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="generate")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.bar.update(1)
        return scores


def hf_generate_kwargs(
    generate_kwargs: dict[str, Any],
    *,
    max_new_tokens: int,
    stop_at_eos: bool,
    eos_token_id: int | list[int] | None,
    use_past_kv_cache: bool,
    freq_penalty: float,
    verbose: bool,
) -> tuple[dict[str, Any], ProgressBar | None]:
    """HF ``generate`` keywords for TL's; the progress bar (to close) when ``verbose``.

    ``stop_at_eos=False`` generates ``max_new_tokens`` whatever comes; ``eos_token_id`` replaces
    the model's end-of-sequence id(s); ``use_past_kv_cache`` is HF's ``use_cache``.
    """
    if freq_penalty != 0.0:
        raise ValueError(
            "freq_penalty (TransformerLens' additive frequency penalty) is not supported; use "
            "repetition_penalty= (Hugging Face's multiplicative one) instead"
        )
    kwargs = dict(generate_kwargs)
    if not stop_at_eos:
        if eos_token_id is not None:
            raise ValueError(
                "eos_token_id says where to stop, but stop_at_eos=False never stops; pass one"
            )
        kwargs["eos_token_id"] = None  # overrides the model's generation_config
    elif eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    kwargs["use_cache"] = use_past_kv_cache
    progress = None
    if verbose:
        progress = ProgressBar(max_new_tokens)
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(progress)
        kwargs["logits_processor"] = processors
    return kwargs, progress
