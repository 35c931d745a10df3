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

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.float8_e4m3fn: "fp8e4nv",
}


def nvidia_tools() -> Path | None:
    """Triton's NVIDIA backend tools, or None where they are missing."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    tools = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
    return tools if (tools / "ptxas").exists() and (tools / "cuobjdump").exists() else None


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
    """Stack bytes and tensor-core use of ``kernel`` compiled for sm_90 with these arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # Specialized as a launch specializes them: 16-byte aligned tensors and integers divisible
    # by 16 marked so (vector loads follow from it), integers equal to 1 made constant.
    signature, constants, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for i, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constants[(i,)] = options[param.name]
        elif isinstance(args[i], torch.Tensor):
            signature[param.name] = "*" + TYPES[args[i].dtype]
            if args[i].data_ptr() % 16 == 0:
                attrs[(i,)] = divisible
        elif args[i] is None or args[i] == 1:
            signature[param.name] = "constexpr"
            constants[(i,)] = args[i]
        else:
            signature[param.name] = "i32" if -(2**31) <= args[i] < 2**31 else "i64"
            if args[i] % 16 == 0:
                attrs[(i,)] = divisible
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        # Triton's defaults where the launch leaves them out
        options={
            "num_warps": options.get("num_warps", 4),
            "num_stages": options.get("num_stages", 3),
        },
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    fields = dict(
        item.split(":")
        for item in usage.split("REG:")[-1].replace("REG", "").split()
        if ":" in item
    )
    ptx = compiled.asm["ptx"]
    return {
        "stack": int(fields["STACK"]),
        "wgmma": "wgmma" in ptx,
        "mma": "mma.sync" in ptx or "wgmma" in ptx,
        "barriers": ptx.count("bar.sync") + ptx.count("barrier.sync"),
        "word_load_bytes": word_load_bytes(compiled.asm["ttgir"]),
    }


def word_load_bytes(ttgir: str) -> int | None:
    """Fewest bytes one thread loads at once from an int32 tensor (the packed words), read
    from the layouts of the kernel's loads; None without such loads."""
    layouts = {
        name: int(per_thread.split(",")[-1])
        for name, per_thread in re.findall(
            r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\]", ttgir, re.M
        )
    }
    loads = re.findall(
        r"(?:tt\.load|ttg\.async_copy_global_to_local) .*: tensor<[\dx]+!tt\.ptr<i32>, (#blocked\d*)>",
        ttgir,
    )
    return min((4 * layouts[layout] for layout in loads), default=None)
