"""TransformerLens 4.3 as an oracle: a TL ``TransformerBridge`` on a copy of a tiny HF model.

TransformerLens 4 has no ``HookedTransformer``; its ``TransformerBridge.boot_transformers``
wraps a pre-loaded HF model (``hf_model=``) without any hub call when it is also given a
tokenizer. The oracle runs on a deep copy, because TL switches the copy to eager attention and
wraps its modules; the HF weights are unchanged, so its weights equal the original's.
``enable_compatibility_mode(no_processing=True)`` gives TL's HookedTransformer-style API
(``W_Q``, ``blocks``, ``run_with_cache`` names) without folding or centering any weight.

TL's ``to_tokens`` prepends BOS by default (``cfg.default_prepend_bos``); pass the same token
ids to both sides when comparing.

Usage::

    from tl_oracle import tl_bridge
    tl = tl_bridge(hf_model, tokenizer)
    torch.testing.assert_close(tl.W_Q, bridge.W_Q, rtol=0, atol=0)
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch import nn


def tl_tokenizer(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` that TL accepts offline (it would reload one without a BOS flag)."""
    tok = copy.deepcopy(tokenizer)
    tok.init_kwargs["name_or_path"] = tok.init_kwargs.get("name_or_path") or "qlens-oracle"
    tok.init_kwargs["add_bos_token"] = True
    return tok


def tl_bridge(model: nn.Module, tokenizer: Any) -> Any:
    """A TransformerLens 4.3 ``TransformerBridge`` in compatibility mode on a copy of ``model``.

    Weights are not processed (no LayerNorm folding, no centering): logits and weights are the
    HF model's own, as in qlens.
    """
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = copy.deepcopy(model).eval()
    logging.getLogger("transformer_lens").setLevel(logging.ERROR)
    tl = TransformerBridge.boot_transformers(
        "qlens-oracle",
        hf_model=hf_model,
        tokenizer=tl_tokenizer(tokenizer),
        device="cpu",
        dtype=next(model.parameters()).dtype,
    )
    tl.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    return tl.eval()
