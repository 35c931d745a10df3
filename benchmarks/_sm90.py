"""Triton kernels compiled for sm_90 (Hopper) on any machine, no GPU needed: the specialization a
real launch gets, the cubin's resource usage and SASS, and the instructions of its loops.

``nvidia_tools()`` is Triton's NVIDIA backend ``bin`` folder (ptxas, cuobjdump), or None."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from collections import Counter
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


def record_launches() -> list[tuple]:
    """Make qlens' prepared launches record ``(kernel, arguments, options)`` instead of running,
    as the H200 launch tables choose them, with CPU tensors standing in for the GPU's (for good:
    a script that compiles what it records calls this once). Returns the list they go to."""
    import qlens.kernels.configs as configs
    import qlens.kernels.dispatch as dispatch
    import qlens.kernels.experts as experts
    from qlens.kernels.fast_launch import PreparedLaunch

    configs.gpu_name = lambda device: "NVIDIA H200"
    configs.sm_count = lambda device: 132
    dispatch.require_kernel_device = lambda device: None
    experts.kernel_device_problem = lambda device: None
    recorded: list[tuple] = []
    PreparedLaunch.__call__ = lambda self, *tensors: recorded.append(  # type: ignore[method-assign]
        (self.launcher.kernel, self.arguments(*tensors), self._options)
    )
    return recorded


def compile_for_sm90(kernel: Any, args: tuple, options: dict) -> Any:
    """``kernel`` compiled for sm_90 with the signature of the recorded ``args`` (tensors by
    dtype, integers by range) and the recorded constexprs and launch ``options``, specialized as
    a launch specializes them: 16-byte aligned tensors and integers divisible by 16 marked so
    (vector loads follow from it), integers equal to 1 made constant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

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
    return triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        # Triton's defaults where the launch leaves them out
        options={
            "num_warps": options.get("num_warps", 4),
            "num_stages": options.get("num_stages", 3),
        },
    )


def cuobjdump(compiled: Any, tools: str | Path, flag: str) -> str:
    """What ``cuobjdump <flag>`` prints of the compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run(
            [os.path.join(tools, "cuobjdump"), flag, f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)


def barriers(compiled: Any) -> int:
    """Barriers in the compiled kernel's PTX (each a shared-memory exchange)."""
    ptx = compiled.asm["ptx"]
    return ptx.count("bar.sync") + ptx.count("barrier.sync")


def stack_bytes(compiled: Any, tools: str | Path) -> int:
    """Bytes of stack a thread (registers spilled to local memory)."""
    usage = cuobjdump(compiled, tools, "--dump-resource-usage")
    fields = dict(
        item.split(":")
        for item in usage.split("REG:")[-1].replace("REG", "").split()
        if ":" in item
    )
    return int(fields["STACK"])


_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_BACKWARD = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s+)?0x([0-9a-f]+)")


def sass_loops(sass: str) -> list[Counter]:
    """The opcodes of each loop of a SASS listing (a backward branch and the instructions from
    its target to it; not the branch to itself that ends a kernel), counted, with their
    modifiers and without their predicates."""
    instructions = [(int(a, 16), text) for a, text in _INSTRUCTION.findall(sass)]
    loops = []
    for address, text in instructions:
        branch = _BACKWARD.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [t for a, t in instructions if start <= a <= address]
            loops.append(Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in body))
    return loops
