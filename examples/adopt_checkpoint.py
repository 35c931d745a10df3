"""A model quantized by bitsandbytes (NF4) at load time, inspected with qlens.

Run: .venv/bin/python examples/adopt_checkpoint.py [--out DIR]   (mirrors notebooks/04_adopt_checkpoint)
"""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import torch
from _output import output_dir, save_html
from transformers import BitsAndBytesConfig

import qlens
from qlens.models import default_model_dir
from qlens.quant.adopt import adopt_module
from qlens.viz import render_bridge_html, render_payload_html
from qlens.weights import W_Q, unreadable_weights

out = output_dir(__doc__)
nf4 = BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
)
bridge = qlens.load(default_model_dir(), quantization_config=nf4, device_map="cpu")
save_html(out, "bridge.html", render_bridge_html(bridge))

logits = bridge("The capital of France is")
print(f"next token: {bridge.to_string([int(logits[0, -1].argmax())])!r}")
print(f"{len(unreadable_weights(bridge.model))} weights are packed NF4")
try:
    W_Q(bridge, 0)
except NotImplementedError as error:
    print(f"guard: {error}")

q_proj = bridge.model.model.layers[0].self_attn.q_proj
save_html(out, "payload.html", render_payload_html(adopt_module(q_proj)))
ours = qlens.dequantize(q_proj)
theirs = bnb_functional.dequantize_4bit(q_proj.weight.data, q_proj.weight.quant_state)
assert torch.equal(ours, theirs.float())
print(f"qlens.dequantize(q_proj) {tuple(ours.shape)} equals bitsandbytes' dequantize_4bit exactly")
