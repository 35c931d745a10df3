"""Compile recorded Triton launches for sm_90 on the CPU and read their resource usage.

``run_compile_script(script)`` runs ``script`` in a fresh interpreter without
``TRITON_INTERPRET`` (the GPU code path), with Triton's tools folder as its argument, and returns
the JSON list it prints last. ``compile_sm90(kernel, args, options, tools)`` compiles ``kernel``
with the signature of the recorded ``args`` (tensors by dtype, integers by range, both with the
alignment a launch specializes on) and the recorded constexprs and launch options, and returns
the bytes spilled to the stack, which tensor-core instructions its PTX holds, how many
barriers (each a shared-memory exchange) and the bytes a thread loads at once from the packed
words. ``tools`` is Triton's NVIDIA backend ``bin`` folder
(ptxas, cuobjdump).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._sm90 import barriers, compile_for_sm90, nvidia_tools, stack_bytes

__all__ = ["compile_sm90", "nvidia_tools", "run_compile_script", "word_load_bytes"]


def run_compile_script(script: str) -> list[dict[str, Any]]:
    """The JSON results ``script`` prints, run on the GPU code path with the tools' folder."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here)])
    done = subprocess.run(
        [sys.executable, "-c", script, str(nvidia_tools())],
        capture_output=True,
        text=True,
        env=env,
        cwd=here.parents[1],
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_sm90(kernel: Any, args: tuple, options: dict, tools: str) -> dict[str, Any]:
    """Stack bytes and tensor-core use of ``kernel`` compiled for sm_90 with these arguments
    (specialized as a launch specializes them: ``benchmarks._sm90.compile_for_sm90``)."""
    compiled = compile_for_sm90(kernel, args, options)
    ptx = compiled.asm["ptx"]
    return {
        "stack": stack_bytes(compiled, tools),
        "wgmma": "wgmma" in ptx,
        "mma": "mma.sync" in ptx or "wgmma" in ptx,
        "barriers": barriers(compiled),
        "word_load_bytes": word_load_bytes(compiled.asm["ttgir"]),
    }


def word_load_bytes(ttgir: str) -> int | None:
    """Fewest bytes one thread loads at once from an int32 tensor (the packed words), read
    from the layouts of the kernel's loads (elements a thread holds along the layout's fastest
    dimension); None without such loads."""
    layouts = {
        name: [int(v) for v in per_thread.split(",")][int(order.split(",")[0])]
        for name, per_thread, order in re.findall(
            r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\].*?"
            r"order = \[([\d, ]+)\]",
            ttgir,
            re.M,
        )
    }
    loads = re.findall(
        r"(?:tt\.load|ttg\.async_copy_global_to_local) .*: tensor<[\dx]+!tt\.ptr<i32>, (#blocked\d*)>",
        ttgir,
    )
    return min((4 * layouts[layout] for layout in loads), default=None)
