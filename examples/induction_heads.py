"""Induction heads in SmolLM2, reference against MXFP4 attention weights.

Run: .venv/bin/python examples/induction_heads.py [--out DIR]   (mirrors notebooks/03_induction_heads)
"""

from __future__ import annotations

import torch
from _output import output_dir, save_html

import qlens
from qlens.analysis import repeated_random_tokens, score_patterns
from qlens.modules.model_quantize import DEFAULT_SKIP, quantize
from qlens.viz import AttentionExplorer

out = output_dir(__doc__)
bridge = qlens.load()
tokens = repeated_random_tokens(bridge.cfg.d_vocab, 20, seed=0, low=1000)


def patterns_and_scores(model: qlens.Bridge) -> tuple[qlens.ActivationCache, torch.Tensor]:
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    patterns = torch.stack([cache["pattern", i] for i in range(cache.n_layers)])
    return cache, score_patterns(patterns, tokens, "induction")  # [layer head]


cache, scores = patterns_and_scores(bridge)
mxfp4 = quantize(bridge, "mxfp4", skip=[*DEFAULT_SKIP, "*.mlp.*"])
mxfp4_cache, mxfp4_scores = patterns_and_scores(mxfp4)
best = scores.flatten().topk(5).indices
for index in best:
    layer, head = divmod(int(index), scores.shape[1])
    print(
        f"L{layer}H{head}: induction score {float(scores[layer, head]):.2f} "
        f"(mxfp4 {float(mxfp4_scores[layer, head]):.2f})"
    )
explorer = AttentionExplorer(
    cache, bridge.to_str_tokens(tokens[0]), compare=mxfp4_cache, labels=("reference", "mxfp4")
)
explorer.layer.value, explorer.head.value = divmod(int(best[0]), scores.shape[1])
save_html(out, "induction_head.html", explorer.to_html())
