"""qlens imports no quantization library for a float model, and prints nothing while loading,
running and auditing one (transformers itself imports some of them; those are not qlens')."""

import json
import subprocess
import sys
from pathlib import Path

from qlens.quant.libraries import QUANTIZATION_LIBRARIES, library_of

_SCRIPT = f"""
import json, sys
import qlens  # first, as a user's script does
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def imported():
    return [lib for lib in {QUANTIZATION_LIBRARIES!r} if lib in sys.modules]

by_transformers = imported()
from qlens.report.audit import audit_weights
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2)
model = LlamaForCausalLM(config)
bridge = qlens.load(model)
bridge(torch.tensor([[1, 2, 3]]))
audit_weights(model)
print(json.dumps([by_transformers, imported()]))
"""


def test_float_model_imports_no_library_and_prints_nothing():
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[3],
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    by_transformers, after_qlens = json.loads(done.stdout.strip().splitlines()[-1])
    assert after_qlens == by_transformers  # whatever transformers imports itself, no more
    assert done.stderr == ""


def test_library_of_reads_class_names_only():
    class Fake:
        pass

    Fake.__module__ = "torchao.prototype.mx_formats.mx_tensor"
    assert library_of(Fake()) == "torchao"
    Fake.__module__ = "optimum.quanto.nn.qlinear"
    assert library_of(Fake()) == "optimum.quanto"
    Fake.__module__ = "torchaox.thing"
    assert library_of(Fake()) is None
