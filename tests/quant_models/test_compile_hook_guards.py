"""A compiled model keeps one graph per bridge hook set: switching hooks on and off reuses them,
and a hook's own bookkeeping recompiles nothing (nor does a decoder's recording, which keeps its
hooks and buffers from call to call). Run in a fresh interpreter: the tests' type
checker wraps every function the bridge defines per call (its per-call hooks included) in new
code, which a graph calling them guards on."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch
from torch._dynamo.utils import counters
from tiny_models import input_ids, make_model
from qlens.bridge import Bridge
from qlens.static_decode import StaticDecoder

steering = [("blocks.0.hook_resid_post", lambda x, hook: x + 1.0)]
bridge = Bridge(make_model("llama"))
ids = input_ids()

def graphs(run):
    torch._dynamo.reset()
    counters.clear()
    for on in (True, True, False, False, True, False):
        with bridge.hooks(fwd_hooks=steering if on else []):
            run()
    return counters["stats"]["unique_graphs"]

bridge.model.compile(backend="eager")
with torch.no_grad():
    print("model", graphs(lambda: bridge(ids)))
bridge = Bridge(make_model("llama"))  # not compiled: the decoder compiles its step
decoder = StaticDecoder(bridge, 16, backend="eager")
print("decoder", graphs(lambda: decoder.generate(ids[:1], 4, stop_at_eos=False)))
recorded = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
print("recording", graphs(
    lambda: decoder.generate_with_cache(ids[:1], 4, recorded, stop_at_eos=False)))
"""


def test_each_hook_set_compiles_once() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, root]))
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(line.split() for line in run.stdout.splitlines() if line.strip())
    # Two graphs, with and without the hook, over six calls that switch between them; the
    # decoder has two for its step and two for its prompt (recording runs prompts eagerly).
    assert counts == {"model": "2", "decoder": "4", "recording": "2"}, run.stdout
