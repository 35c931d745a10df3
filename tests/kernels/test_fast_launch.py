"""FastLaunch: launch keys, the once-per-key normal launch, the direct launch and the fallback."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from qlens.kernels import LinearConfig
from qlens.kernels.fast_launch import (
    FastLaunch,
    PreparedLaunch,
    arg_key,
    launch_key,
    triton_version,
)
from qlens.kernels.runtime import interpreting
from qlens.quant.quantize import quantize_weight


@dataclass
class FakeParam:
    name: str
    is_constexpr: bool


@dataclass
class FakeCompiled:
    """Records direct launches the way ``CompiledKernel.run`` receives them."""

    function: str = "fn"
    packed_metadata: tuple[int, ...] = (4, 1)
    runs: list[tuple[Any, ...]] = field(default_factory=list)

    def run(self, *call: Any) -> None:
        self.runs.append(call)

    def launch_metadata(self, grid: Any, stream: int, *args: Any) -> str:
        return "metadata"


def _signature(a: Any, b: Any, n: Any, BLOCK: Any, FLAG: Any = True) -> None:  # noqa: N803
    return None


class FakeKernel:
    """A JIT function with parameters ``a, b, n, BLOCK (constexpr), FLAG (constexpr = True)``."""

    __name__ = "fake_kernel"
    signature = inspect.signature(_signature)
    params = [
        FakeParam("a", False),
        FakeParam("b", False),
        FakeParam("n", False),
        FakeParam("BLOCK", True),
        FakeParam("FLAG", True),
    ]

    def __init__(self) -> None:
        self.normal: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self.compiled: list[FakeCompiled] = []

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> FakeCompiled:
            self.normal.append((grid, args, kwargs))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]

        return run


class FakeRuntime:
    def __init__(self, enter: Any = None) -> None:
        self.device = 0
        self.enter = enter

    def current_device(self) -> int:
        return self.device

    def current_stream(self, device: int) -> int:
        return 1000 + device

    def hooks(self) -> tuple[Any, Any]:
        return self.enter, None


def _fast(kernel: FakeKernel, runtime: FakeRuntime | None = None) -> FastLaunch:
    launcher = FastLaunch(kernel)
    launcher._runtime, launcher._resolved = runtime or FakeRuntime(), True
    return launcher


def test_arg_key_follows_what_triton_specializes_on() -> None:
    buf = torch.zeros(64, dtype=torch.float16)
    assert arg_key(buf) == (torch.float16, True)
    assert arg_key(buf[1:]) == (torch.float16, False)  # 2 bytes past an aligned start
    assert arg_key(buf[8:]) == (torch.float16, True)  # 16 bytes past
    assert arg_key(buf.view(torch.int16)) == (torch.int16, True)
    assert arg_key(1) == (32, True, False)
    assert arg_key(32) == (32, False, True)
    assert arg_key(33) == (32, False, False)
    assert arg_key(2**31) == (64, False, True)
    assert arg_key(-(2**31)) == (32, False, True)
    assert arg_key(2**63) == (65, False, True)
    assert arg_key(0.5) is float and arg_key(2.0) is float
    assert arg_key(True) is bool and arg_key(False) is bool
    assert arg_key(None) == (type(None), None)


def test_launch_key_includes_device_and_keyword_values() -> None:
    x = torch.zeros(8)
    assert launch_key(0, (x, 3), {"BLOCK": 16}) == (
        0,
        ((torch.float32, True), (32, False, False)),
        (("BLOCK", 16),),
    )
    assert launch_key(1, (x, 3), {"BLOCK": 16}) != launch_key(0, (x, 3), {"BLOCK": 16})
    assert launch_key(0, (x, 3), {"BLOCK": 32}) != launch_key(0, (x, 3), {"BLOCK": 16})


def test_triton_version_parses_release_and_local_versions() -> None:
    assert triton_version("3.6.0") == (3, 6)
    assert triton_version("3.9.0+git1a2b") == (3, 9)
    assert triton_version("3.10rc1") == (3, 10)
    with pytest.raises(ValueError, match="not a Triton version: 'dev'"):
        triton_version("dev")


def test_normal_launch_once_per_key_then_direct_launches() -> None:
    kernel = FakeKernel()
    launcher = _fast(kernel)
    buf = torch.zeros(64, dtype=torch.float16)
    for call in range(3):
        a, b = torch.zeros(16, dtype=torch.float16), torch.zeros(16, dtype=torch.float16)
        launcher.launch((4, 2), a, b, 48, BLOCK=16, num_warps=4)
        assert len(kernel.normal) == 1, call
    (compiled,) = kernel.compiled
    assert len(compiled.runs) == 2
    run = compiled.runs[-1]
    assert run[:9] == (4, 2, 1, 1000, "fn", (4, 1), None, None, None)
    # Direct launches pass tensors as their addresses, which Triton's launcher reads unchecked.
    assert run[9] == a.data_ptr() and run[10] == b.data_ptr()
    assert run[11:] == (48, 16, True)  # runtime args, then BLOCK, then FLAG's default

    launcher.launch((4,), buf[1:], b, 48, BLOCK=16, num_warps=4)  # misaligned pointer
    launcher.launch((4,), a, b, 49, BLOCK=16, num_warps=4)  # n no longer divisible by 16
    launcher.launch((4,), a, b, 1, BLOCK=16, num_warps=4)  # n == 1
    launcher.launch((4,), a.float(), b, 48, BLOCK=16, num_warps=4)  # dtype
    launcher.launch((4,), a, b, 48, BLOCK=32, num_warps=4)  # constexpr
    launcher.launch((4,), a, b, 48, BLOCK=16, num_warps=8)  # launch option
    launcher.launch((4,), a, b, 48, BLOCK=16, FLAG=False, num_warps=4)  # defaulted constexpr
    assert len(kernel.normal) == 8
    assert len(set(launcher.cached_keys())) == 8
    launcher.launch((7, 3, 2), a, b, 64, BLOCK=16, num_warps=4)  # same key as the first launch
    assert len(kernel.normal) == 8
    assert compiled.runs[-1][:3] == (7, 3, 2)


def test_a_new_device_takes_a_normal_launch_and_its_own_stream() -> None:
    kernel, runtime = FakeKernel(), FakeRuntime()
    launcher = _fast(kernel, runtime)
    a = torch.zeros(16)
    launcher.launch((1,), a, a, 16, BLOCK=16)
    runtime.device = 1
    launcher.launch((1,), a, a, 16, BLOCK=16)
    launcher.launch((1,), a, a, 16, BLOCK=16)
    assert len(kernel.normal) == 2
    assert kernel.compiled[1].runs[0][3] == 1001


def test_enter_hook_gets_launch_metadata() -> None:
    def hook(metadata: Any) -> None:
        return None

    kernel = FakeKernel()
    launcher = _fast(kernel, FakeRuntime(enter=hook))
    a = torch.zeros(16)
    launcher.launch((1,), a, a, 16, BLOCK=16)
    launcher.launch((1,), a, a, 16, BLOCK=16)
    assert kernel.compiled[0].runs[0][6:8] == ("metadata", hook)


def test_direct_off_takes_the_normal_launch_every_time() -> None:
    kernel = FakeKernel()
    launcher = _fast(kernel)
    a = torch.zeros(16)
    FastLaunch.direct = False
    try:
        for _ in range(3):
            launcher.launch((1,), a, a, 16, BLOCK=16)
    finally:
        FastLaunch.direct = True
    assert len(kernel.normal) == 3 and launcher.cached_keys() == []
    launcher.launch((1,), a, a, 16, BLOCK=16)
    launcher.launch((1,), a, a, 16, BLOCK=16)
    assert len(kernel.normal) == 4 and len(kernel.compiled[-1].runs) == 1


def test_runtime_parameter_by_keyword_is_an_error() -> None:
    launcher = _fast(FakeKernel())
    a = torch.zeros(16)
    with pytest.raises(TypeError, match="pass runtime parameter 'n' by position"):
        launcher.launch((1,), a, a, n=16, BLOCK=16)


def test_missing_constexpr_is_an_error() -> None:
    launcher = _fast(FakeKernel())
    a = torch.zeros(16)
    with pytest.raises(TypeError, match="constexpr 'BLOCK' has no value"):
        launcher.launch((1,), a, a, 16)


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")
def test_interpreted_kernel_takes_the_normal_launch() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    launcher = FastLaunch(add_one)
    x = torch.zeros(10)
    launcher.launch((1,), x, 10, BLOCK=16)
    launcher.launch((1,), x, 10, BLOCK=16)
    assert torch.equal(x, torch.full((10,), 2.0))
    assert launcher.cached_keys() == []  # the interpreter has no compiled kernel to keep


LAUNCH_SITE_CALLS = (
    (("int4", {"group_size": 32}), False, 1, LinearConfig("gemv", 16, 32, 128)),
    (("int8", {"group_size": 64}), False, 1, LinearConfig("gemv", 16, 16, 128)),
    (("mxfp4", {}), False, 3, LinearConfig("splitk", 16, 32, 64, split_k=2)),
    (("fp8-block", {}), True, 1, LinearConfig("splitk", 16, 64, 128, split_k=2)),
)


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")
def test_every_launch_site_passes_runtime_parameters_by_position(monkeypatch):
    """What the direct launch needs of its call sites: runtime parameters by position, then
    every constexpr by keyword or default (checked against each kernel's own signature)."""
    from triton.runtime.jit import JITFunction

    from qlens.kernels import dequantize_triton, quantized_linear
    from qlens.kernels.dequant import _DEQUANT
    from qlens.kernels.fast_launch import _tail_arguments
    from qlens.kernels.fp8_w8a8 import _ACT_QUANT, _FP8_BLOCK_GEMM
    from qlens.kernels.gemv import _GEMV, PACKED_GEMV
    from qlens.kernels.splits import _REDUCE
    from qlens.kernels.weight_only import _WEIGHT_ONLY

    recorded: list[tuple[FastLaunch, tuple[Any, ...], dict[str, Any]]] = []
    normal_launch = FastLaunch.launch

    def record(self: FastLaunch, grid: Any, *args: Any, **options: Any) -> None:
        recorded.append((self, args, options))
        normal_launch(self, grid, *args, **options)

    prepared_launch = PreparedLaunch.__call__

    def record_prepared(self: PreparedLaunch, *tensors: torch.Tensor) -> None:
        recorded.append((self.launcher, self.arguments(*tensors), self._options))
        prepared_launch(self, *tensors)

    monkeypatch.setattr(FastLaunch, "launch", record)
    monkeypatch.setattr(PreparedLaunch, "__call__", record_prepared)
    gen = torch.Generator().manual_seed(0)
    for (scheme, kwargs), w8a8, m, cfg in LAUNCH_SITE_CALLS:
        payload = quantize_weight(torch.randn(32, 256, generator=gen), scheme, **kwargs)
        quantized_linear(torch.randn(m, 256, generator=gen), payload, w8a8=w8a8, config=cfg)
    dequantize_triton(payload, torch.bfloat16)

    seen = {launcher for launcher, _, _ in recorded}
    assert seen == {
        PACKED_GEMV,
        _GEMV,
        _WEIGHT_ONLY,
        _ACT_QUANT,
        _FP8_BLOCK_GEMM,
        _DEQUANT,
        _REDUCE,
    }
    for launcher, args, options in recorded:
        kernel = JITFunction(launcher.kernel.fn)  # the compiled kernel's parameters
        tail = _tail_arguments(kernel, args, options)
        assert len(args) + len(tail) == len(kernel.params), launcher.kernel.__name__
        for param, value in zip(kernel.params[len(args) :], tail, strict=True):
            assert param.is_constexpr
            assert value is options.get(param.name, kernel.signature.parameters[param.name].default)


def _prepared(
    kernel: FakeKernel, runtime: FakeRuntime | None = None, device: str = "cpu"
) -> tuple[PreparedLaunch, torch.Tensor]:
    """A launch of ``(a, b, 48)`` with ``b`` fixed and ``a`` the per-call slot."""
    fixed = torch.zeros(16, dtype=torch.float16)
    launch = _fast(kernel, runtime).prepare(
        (4,), (None, fixed, 48), [0], torch.device(device), BLOCK=16, num_warps=4
    )
    return launch, fixed


def test_prepared_launch_fills_its_slots_and_keys_only_them() -> None:
    kernel = FakeKernel()
    launch, fixed = _prepared(kernel)
    buf = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):
        launch(buf[8:24])
    assert len(kernel.normal) == 1
    grid, args, options = kernel.normal[0]
    assert grid == (4, 1, 1) and args[1] is fixed and args[2] == 48
    assert options == {"BLOCK": 16, "num_warps": 4}
    run = kernel.compiled[0].runs[-1]
    assert len(kernel.compiled[0].runs) == 2
    assert run[:9] == (4, 1, 1, 1000, "fn", (4, 1), None, None, None)
    assert run[9] == buf[8:].data_ptr() and run[10] == fixed.data_ptr()  # addresses
    assert run[11:] == (48, 16, True)
    launch(buf[1:17])  # misaligned: Triton compiles another specialization
    launch(buf.float()[:16])  # another dtype
    launch(buf[16:32])  # aligned float16 again: the first key
    assert len(kernel.normal) == 3
    assert launch.cached_keys() == [
        (0, (torch.float16, True)),
        (0, (torch.float16, False)),
        (0, (torch.float32, True)),
    ]


def test_prepared_launch_arguments_interleave_fixed_values_and_slots() -> None:
    launcher = _fast(FakeKernel())
    a, b = torch.zeros(4), torch.ones(4)
    launch = launcher.prepare((1,), (None, 7, None, 9), [0, 2], torch.device("cpu"), BLOCK=16)
    assert launch.arguments(a, b) == (a, 7, b, 9)
    with pytest.raises(ValueError, match="slots must be increasing positions"):
        launcher.prepare((1,), (None, 7), [1, 0], torch.device("cpu"), BLOCK=16)
    with pytest.raises(ValueError, match="slots must be increasing positions"):
        launcher.prepare((1,), (None, 7), [2], torch.device("cpu"), BLOCK=16)
    with pytest.raises(ValueError, match="zip"):
        launch.arguments(a)


def test_prepared_launch_runs_on_its_own_device(monkeypatch) -> None:
    kernel, runtime = FakeKernel(), FakeRuntime()
    launch, _ = _prepared(kernel, runtime, device="cuda:1")
    entered: list[int] = []

    class SwitchDevice:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            entered.append(self.index)
            self.previous, runtime.device = runtime.device, self.index

        def __exit__(self, *exc: Any) -> None:
            runtime.device = self.previous

    monkeypatch.setattr(torch.cuda, "device", SwitchDevice)
    x = torch.zeros(16, dtype=torch.float16)
    launch(x)
    launch(x)
    assert entered == [1, 1] and runtime.device == 0
    assert launch.cached_keys() == [(1, (torch.float16, True))]
    assert kernel.compiled[0].runs[0][3] == 1001  # the stream of device 1


def test_prepared_launch_honours_direct_off() -> None:
    kernel = FakeKernel()
    launch, _ = _prepared(kernel)
    x = torch.zeros(16, dtype=torch.float16)
    FastLaunch.direct = False
    try:
        launch(x)
        launch(x)
    finally:
        FastLaunch.direct = True
    assert len(kernel.normal) == 2 and launch.cached_keys() == []


def test_launcher_keys_and_clear_cover_its_prepared_launches() -> None:
    kernel = FakeKernel()
    launch, _ = _prepared(kernel)
    launcher = launch.launcher
    x = torch.zeros(16, dtype=torch.float16)
    launch(x)
    launcher.launch((1,), x, x, 16, BLOCK=16)
    assert launcher.cached_keys() == [
        (0, 0, (torch.float16, True)),  # device, the prepared launch's site, its tensor's key
        (0, ((torch.float16, True), (torch.float16, True), (32, False, True)), (("BLOCK", 16),)),
    ]
    launcher.clear()
    assert launcher.cached_keys() == [] and launch.cached_keys() == []
    launch(x)  # the normal launch again
    assert len(kernel.normal) == 3


def test_prepared_launches_of_one_site_share_their_compiled_kernels() -> None:
    kernel = FakeKernel()
    launcher = _fast(kernel)
    fixed, other = torch.zeros(16), torch.zeros(32)
    cpu = torch.device("cpu")
    first = launcher.prepare((4,), (None, fixed, 48), [0], cpu, BLOCK=16)
    same = launcher.prepare((8,), (None, other, 64), [0], cpu, BLOCK=16)  # equal keys
    x = torch.zeros(16, dtype=torch.float16)
    first(x)
    same(x)  # direct: the kernel compiled for the first is the one Triton would pick
    assert len(kernel.normal) == 1 and kernel.compiled[0].runs[0][:3] == (8, 1, 1)
    assert kernel.compiled[0].runs[0][10] == other.data_ptr()
    assert kernel.compiled[0].runs[0][11] == 64
    for fixed_args, options in (
        ((None, fixed, 49), {"BLOCK": 16}),  # an int no longer divisible by 16
        ((None, fixed[1:], 48), {"BLOCK": 16}),  # a misaligned fixed tensor
        ((None, fixed, 48), {"BLOCK": 32}),  # another constexpr
    ):
        before = len(kernel.normal)
        launcher.prepare((4,), fixed_args, [0], cpu, **options)(x)
        assert len(kernel.normal) == before + 1, (fixed_args, options)
