"""Launching a compiled Triton kernel with minimal host work.

``JITFunction.run`` binds every argument, builds a specialization string and looks it up on each
call. :class:`FastLaunch` does the first launch of each specialization the normal way, keeps the
compiled kernel it returns, and afterwards calls that kernel's launcher directly, keyed by what
Triton specializes on: each tensor's dtype and 16-byte alignment, each int's equality to 1,
divisibility by 16 and width, the other scalars' types, the constexprs and launch options
(passed by keyword, fixed by the call site) and the current device. A call site whose
arguments are all fixed but a few tensors prepares its launch once (``FastLaunch.prepare``):
the fixed arguments' keys are computed then, and a call keys only its tensors.

Direct launches pass every tensor as its device address (an int): Triton's launcher then
neither calls ``data_ptr()`` nor asks the driver to validate each pointer (one
``cuPointerGetAttribute`` per tensor per launch). The normal first launch of each key still
passes the tensors, so the driver checks them once; later calls of a key reuse tensors on the
device the key names (qlens' plans check devices once, when built).

Checked against Triton 3.6 and 3.9, whose launch call (``CompiledKernel.run(grid0, grid1, grid2,
stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)``) is the
same. Other versions, the CPU interpreter and non-NVIDIA targets take the normal launch.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

SUPPORTED_TRITON = ((3, 6), (4, 0))  # [lowest, highest) (major, minor) with the checked launcher


def triton_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string such as ``3.6.0`` or ``3.9.0+git1a2b``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a Triton version: {version!r} (expected 'major.minor...')")
    return int(match.group(1)), int(match.group(2))


def arg_key(arg: Any) -> Any:
    """What Triton specializes a non-constexpr argument on (a superset: more keys, never fewer).

    Tensors: dtype and 16-byte alignment; ints: width class, ``== 1`` and ``% 16 == 0``; bools and
    floats only by type (Triton passes them unspecialized); anything else by value.
    """
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    kind = type(arg)
    if kind is int:
        width = 32 if -(2**31) <= arg < 2**31 else (64 if arg < 2**63 else 65)
        return width, arg == 1, arg % 16 == 0
    if kind is bool or kind is float:
        return kind
    return kind, arg


def launch_key(device: int, args: Sequence[Any], options: dict[str, Any]) -> tuple[Any, ...]:
    """The cache key of one launch: device, each positional argument's key, keyword values."""
    return (device, tuple(map(arg_key, args)), tuple(options.items()))


class FastLaunch:
    """``FastLaunch(kernel).launch(grid, *args, **constexprs_and_options)`` launches ``kernel``.

    Runtime arguments go by position, constexprs and launch options (``num_warps``...) by
    keyword. The first call of each key runs ``kernel[grid](...)``; later ones call the compiled
    kernel's launcher with the arguments in the kernel's parameter order.
    """

    direct = True  # False: every launcher takes the normal launch (for comparisons)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        self._sites: dict[tuple[Any, ...], int] = {}  # prepared launches' fixed keys, numbered
        self._runtime: _Runtime | None = None
        self._resolved = False  # the runtime is looked up at the first launch, not at import

    def launch(self, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
        runtime = self.runtime()
        if runtime is None or not FastLaunch.direct:
            self.kernel[grid](*args, **options)
            return
        device = runtime.current_device()
        key = launch_key(device, args, options)
        entry = self._compiled.get(key)
        if entry is None:
            self._compiled[key] = self._first_launch(grid, args, options)
            return
        compiled, tail = entry
        stream = runtime.current_stream(device)
        enter, exit_ = runtime.hooks()
        metadata = compiled.launch_metadata(grid, stream, *args, *tail) if enter else None
        compiled.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            stream, compiled.function, compiled.packed_metadata, metadata, enter, exit_,
            *map(_address, args), *tail,
        )  # fmt: skip

    def _first_launch(
        self, grid: tuple[int, ...], args: tuple[Any, ...], options: dict[str, Any]
    ) -> tuple[Any, tuple[Any, ...]]:
        """The normal launch, and the compiled kernel with the parameters after ``args``."""
        compiled = self.kernel[grid](*args, **options)
        if hasattr(compiled, "result"):  # asynchronous compilation hands back a future
            compiled = compiled.result()
        return compiled, _tail_arguments(self.kernel, args, options)

    def prepare(
        self,
        grid: tuple[int, ...],
        args: Sequence[Any],
        slots: Sequence[int],
        device: torch.device,
        **options: Any,
    ) -> PreparedLaunch:
        """One launch with everything fixed but the tensors at positions ``slots`` of ``args``
        (the placeholders there are ignored), run on ``device``: see :class:`PreparedLaunch`."""
        return PreparedLaunch(self, grid, args, slots, device, options)

    def site(self, fixed_key: tuple[Any, ...]) -> int:
        """The number of a prepared launch's fixed key (its fixed arguments' keys, slots and
        keyword values): prepared launches with equal fixed keys share their compiled kernels."""
        return self._sites.setdefault(fixed_key, len(self._sites))

    def runtime(self) -> _Runtime | None:
        """The direct-launch runtime (looked up at the first call), or None for the normal one."""
        if not self._resolved:
            self._runtime, self._resolved = _fast_runtime(self.kernel), True
        return self._runtime

    def clear(self) -> None:
        """Forget the compiled kernels (the prepared launches' too): the next launch of each key
        takes the normal path."""
        self._compiled.clear()

    def cached_keys(self) -> list[tuple[Any, ...]]:
        """The launch keys seen so far, in order (one normal launch each), prepared launches'
        ``(device, site, tensor keys...)`` among them."""
        return list(self._compiled)


class PreparedLaunch:
    """A launch whose grid, options and arguments are fixed except a few tensors (``slots``).

    ``launch(t0, t1, ...)`` puts the tensors at their slots and launches. Only their keys
    (dtype, 16-byte alignment) and the current device are computed per call: the other
    arguments are fixed, so their keys are too, computed once into the launcher's numbered
    ``site``. The first call of each (device, site, tensor keys) takes the normal launch; later
    ones, from this or any prepared launch of the same site, call the compiled kernel's
    launcher directly. A call whose current device is not ``device`` switches to it.
    """

    __slots__ = (
        "_addresses", "_device", "_grid", "_options", "_parts", "_site", "_slots", "launcher"
    )  # fmt: skip

    def __init__(
        self,
        launcher: FastLaunch,
        grid: tuple[int, ...],
        args: Sequence[Any],
        slots: Sequence[int],
        device: torch.device,
        options: dict[str, Any],
    ) -> None:
        if list(slots) != sorted(set(slots)) or not all(0 <= s < len(args) for s in slots):
            raise ValueError(f"slots must be increasing positions in the arguments, got {slots}")
        self.launcher = launcher
        self._grid: tuple[int, int, int] = (*grid, 1, 1)[:3]  # type: ignore[assignment]
        self._options = options
        self._slots = tuple(slots)
        # The fixed arguments between the slots: args = parts[0], t0, parts[1], t1, ...
        bounds = (-1, *slots, len(args))
        self._parts = tuple(
            tuple(args[a + 1 : b]) for a, b in zip(bounds, bounds[1:], strict=False)
        )
        # The same with each fixed tensor as its address (the direct launch's arguments); the
        # tensors themselves stay referenced in ``_parts``.
        self._addresses = tuple(tuple(map(_address, part)) for part in self._parts)
        self._device = device.index if device.type == "cuda" else None
        fixed = tuple(arg_key(arg) for part in self._parts for arg in part)
        self._site = launcher.site((fixed, self._slots, tuple(options.items())))

    @property
    def grid(self) -> tuple[int, int, int]:
        """The launch grid, three dimensions."""
        return self._grid

    @property
    def options(self) -> dict[str, Any]:
        """The constexprs and launch options, by keyword."""
        return self._options

    def arguments(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        """The kernel's positional arguments with ``tensors`` at the slots."""
        return tuple(_interleave(self._parts, tensors))

    def __call__(self, *tensors: torch.Tensor) -> None:
        runtime = self.launcher.runtime()
        if runtime is None or not FastLaunch.direct:
            grid = self._grid
            self.launcher.kernel[grid](*self.arguments(*tensors), **self._options)
            return
        device = runtime.current_device()
        if self._device is not None and device != self._device:
            with torch.cuda.device(self._device):
                self(*tensors)
            return
        pointers = [t.data_ptr() for t in tensors]
        key = (
            device, self._site,
            *[(t.dtype, p % 16 == 0) for t, p in zip(tensors, pointers, strict=True)],
        )  # fmt: skip
        compiled_kernels = self.launcher._compiled
        entry = compiled_kernels.get(key)
        if entry is None:
            args = self.arguments(*tensors)
            compiled_kernels[key] = self.launcher._first_launch(self._grid, args, self._options)
            return
        compiled, tail = entry
        stream = runtime.current_stream(device)
        enter, exit_ = runtime.hooks()
        grid = self._grid
        metadata = None
        if enter:
            metadata = compiled.launch_metadata(grid, stream, *self.arguments(*tensors), *tail)
        addresses = _interleave(self._addresses, pointers)
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            metadata, enter, exit_, *addresses, *tail,
        )  # fmt: skip

    def cached_keys(self) -> list[tuple[Any, ...]]:
        """The ``(device, tensor keys...)`` of this launch's site seen so far, in order."""
        site = self._site
        return [
            (key[0], *key[2:])
            for key in self.launcher._compiled
            if type(key[1]) is int and key[1] == site
        ]


def _interleave(parts: tuple[tuple[Any, ...], ...], slotted: Sequence[Any]) -> list[Any]:
    """``parts[0], slotted[0], parts[1], slotted[1], ...`` flattened: fixed arguments and the
    values at the slots between them."""
    args = list(parts[0])
    for value, part in zip(slotted, parts[1:], strict=True):
        args.append(value)
        args.extend(part)
    return args


def _address(arg: Any) -> Any:
    """A tensor's device address (what Triton's launcher reads from an int unchecked); any
    other argument unchanged."""
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def _tail_arguments(kernel: Any, args: tuple[Any, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The values of ``kernel``'s parameters after the positional ones: keyword constexprs or
    defaults. Runtime parameters must come by position (their keys depend on the value)."""
    tail = []
    signature = kernel.signature.parameters
    for param in kernel.params[len(args) :]:
        name = param.name
        if not param.is_constexpr:
            raise TypeError(
                f"FastLaunch({kernel.__name__}): pass runtime parameter {name!r} by position; "
                "only constexprs and launch options may go by keyword"
            )
        if name in options:
            tail.append(options[name])
        elif signature[name].default is not inspect.Parameter.empty:
            tail.append(signature[name].default)
        else:
            raise TypeError(f"FastLaunch({kernel.__name__}): constexpr {name!r} has no value")
    return tuple(tail)


class _Runtime:
    """The device, stream and launch hooks of the active Triton driver, read per launch."""

    def __init__(self, driver: Any, knobs: Any) -> None:
        self.current_device: Callable[[], int] = driver.get_current_device
        self.current_stream: Callable[[int], int] = driver.get_current_stream
        self._knobs = knobs

    def hooks(self) -> tuple[Any, Any]:
        """The launch hooks, None for none (Triton 3.9 keeps them as possibly empty chains)."""
        runtime = self._knobs.runtime
        return _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)


def _hook(hook: Any) -> Any:
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


def _fast_runtime(kernel: Any) -> _Runtime | None:
    """The direct-launch runtime, or None where ``kernel`` must take the normal launch."""
    try:
        import triton
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    lowest, highest = SUPPORTED_TRITON
    if not isinstance(kernel, JITFunction):  # the CPU interpreter's InterpretedFunction
        return None
    if not lowest <= triton_version(triton.__version__) < highest:
        return None
    active = driver.active
    if active.get_current_target().backend != "cuda":
        return None
    return _Runtime(active, knobs)
