"""Quickstart: load the embedded model, cache a run, view it, patch an activation.

Run: .venv/bin/python examples/quickstart.py [--out DIR]   (mirrors notebooks/01_quickstart)
"""

from __future__ import annotations

import torch
from _output import output_dir, save_html

import qlens
from qlens.viz import AttentionExplorer, LogitLensTable, render_bridge_html

out = output_dir(__doc__)
bridge = qlens.load()  # SmolLM2-135M-Instruct, float32 on the CPU
print(bridge)

prompt = "The capital of France is"
logits, cache = bridge.run_with_cache(prompt)
prediction = bridge.to_string([int(logits[0, -1].argmax())])
print(f"next token: {prediction!r}; cached {len(cache)} activations")

tokens = bridge.to_str_tokens(prompt)
explorer = AttentionExplorer(cache, tokens)
explorer.layer.value, explorer.head.value = 3, 1
lens = LogitLensTable.from_bridge(bridge, prompt)
print("logit lens, final layer:", dict(lens.displayed)["final_post"][:3])
save_html(out, "bridge.html", render_bridge_html(bridge))
save_html(out, "attention.html", explorer.to_html())
save_html(out, "logit_lens.html", lens.to_html())

# Activation patching: the clean residual stream at the repeated name restores the answer.
clean = bridge.to_tokens("When Mary and John went to the store, John gave a drink to")
corrupt = bridge.to_tokens("When Mary and John went to the store, Mary gave a drink to")
mary, john = (int(bridge.to_tokens(name)[0, -1]) for name in (" Mary", " John"))
position = int((clean != corrupt).nonzero()[0, 1])
name = "blocks.10.hook_resid_pre"
_, clean_cache = bridge.run_with_cache(clean, names_filter=[name])


def patch(resid: torch.Tensor, hook: qlens.HookPoint) -> torch.Tensor:
    resid = resid.clone()
    resid[:, position] = clean_cache[hook.name][:, position]
    return resid


with torch.no_grad():
    for label, logits in (
        ("clean", bridge(clean)),
        ("corrupted", bridge(corrupt)),
        (f"corrupted, {name} patched", bridge.run_with_hooks(corrupt, fwd_hooks=[(name, patch)])),
    ):
        print(
            f"{label:<40} logit(Mary) - logit(John) = {float(logits[0, -1, mary] - logits[0, -1, john]):+.2f}"
        )
