"""Quantized tour: every scheme on one weight, a quantized model's drift, the guard, dequantize.

Run: .venv/bin/python examples/quantized_tour.py [--out DIR]   (mirrors notebooks/02_quantized_tour)
"""

from __future__ import annotations

import torch
from _output import output_dir, save_html

import qlens
from qlens.analysis import quantization_drift
from qlens.modules.model_quantize import DEFAULT_SKIP, SCHEMES, quantize
from qlens.viz import DriftDashboard, render_payload_html
from qlens.weights import W_Q, dequantized

out = output_dir(__doc__)
bridge = qlens.load()

weight = bridge.model.model.layers[0].self_attn.q_proj.weight.detach()
for scheme in SCHEMES:
    payload = qlens.quantize_weight(weight, scheme)
    error = (qlens.dequantize(payload) - weight).norm() / weight.norm()
    print(
        f"{scheme:<10} {payload.bits_per_weight:5.2f} bits/weight, relative error {float(error):.4f}"
    )
save_html(out, "payload.html", render_payload_html(qlens.quantize_weight(weight, "mxfp4")))

# MLPs stay in float to keep this quick on a CPU; drop skip= to quantize every linear layer.
quantized = quantize(bridge, "mxfp4", skip=[*DEFAULT_SKIP, "*.mlp.*"])
report = quantization_drift(
    bridge, quantized, "The capital of France is Paris. The capital of Italy is"
)
print(f"drift: final cosine {report.resid_cosine[-1]:.4f}, KL {report.logit_kl:.4f} nats")
save_html(out, "drift.html", DriftDashboard(report).to_html())
for scheme in SCHEMES:  # every scheme, on the same attention-only quantization
    copy = quantize(bridge, scheme, skip=[*DEFAULT_SKIP, "*.mlp.*"])
    r = quantization_drift(bridge, copy, "The capital of France is Paris. The capital of Italy is")
    print(f"drift {scheme}: final cosine {r.resid_cosine[-1]:.4f}, KL {r.logit_kl:.4f} nats")

# Block FP8 as FP8 checkpoints run it: the activations rounded to FP8 too (W8A8).
fp8 = quantize(bridge, "fp8-block", skip=[*DEFAULT_SKIP, "*.mlp.*"])
weight_only = quantization_drift(
    bridge, fp8, "The capital of France is Paris. The capital of Italy is"
)
qlens.set_w8a8(fp8)
w8a8 = quantization_drift(bridge, fp8, "The capital of France is Paris. The capital of Italy is")
print(
    f"fp8-block logit KL: {weight_only.logit_kl:.4f} nats weight-only, "
    f"{w8a8.logit_kl:.4f} with FP8 activations"
)

try:
    W_Q(quantized, 0)
except NotImplementedError as error:
    print(f"guard: {error}")

q_proj = quantized.model.model.layers[0].self_attn.q_proj
with dequantized(quantized):
    w_q = W_Q(quantized, 0)  # [head, d_model, d_head]
w_float = qlens.dequantize(q_proj)  # [out, in]
assert torch.equal(w_q, w_float.reshape(bridge.cfg.n_heads, bridge.cfg.d_head, -1).transpose(1, 2))
print(f"dequantized W_Q of layer 0: {tuple(w_q.shape)}")
