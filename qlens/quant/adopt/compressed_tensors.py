"""compressed-tensors quantized ``nn.Linear`` modules, before their first forward.

compressed-tensors keeps the compressed parameters (``weight_packed``/``weight`` + ``weight_scale``
...) on a plain ``nn.Linear`` carrying a ``quantization_scheme``; a forward pre-hook on the model
(``ct_decompress_hook``) decompresses every module in place into a float ``weight`` on the first
forward. qlens reroutes such modules through its own forward and detaches that hook
(:func:`detach_decompress_hook`), so they stay packed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlens.quant.adopt.core import register_adopter
from qlens.quant.adopt.fp8 import fp8_payload
from qlens.quant.codecs.checks import ceil_div
from qlens.quant.codecs.intgroup import SCALE_DTYPE_NAMES, validate_int_group
from qlens.quant.codecs.mx import pack_mx
from qlens.quant.codecs.nvfp4 import pack_nvfp4
from qlens.quant.formats import int_group_format
from qlens.quant.payload import QuantPayload

SOURCE = "compressed-tensors"
_FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _param(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    return value.detach() if isinstance(value, torch.Tensor) else None


def _required(module: nn.Module, name: str) -> torch.Tensor:
    value = _param(module, name)
    if value is None:
        raise ValueError(
            f"compressed-tensors module {type(module).__name__} lacks its `{name}` parameter; "
            "it is neither fully compressed nor decompressed"
        )
    return value


def _is_compressed(module: nn.Module) -> bool:
    if (
        getattr(module, "quantization_scheme", None) is None
        or _param(module, "weight_scale") is None
    ):
        return False
    if _param(module, "weight_packed") is not None:
        return True
    weight = _param(module, "weight")
    return weight is not None and weight.dtype not in _FLOAT_WEIGHTS


def is_compressed_tensors_module(module: nn.Module) -> bool:
    """A compressed-tensors module still holding its compressed parameters."""
    return _is_compressed(module)


def is_quantization_metadata(module: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``module`` is compressed-tensors bookkeeping (the int64
    ``weight_shape`` it keeps, even after decompressing), not a weight."""
    return name == "weight_shape" and getattr(module, "quantization_scheme", None) is not None


def detach_decompress_hook(model: nn.Module) -> list[str]:
    """Remove compressed-tensors' decompress-on-first-forward hooks; return where they were.

    The hook function is kept as ``ct_decompress_hook_fn`` on its module, so that
    :func:`reattach_decompress_hook` can put it back.
    """
    detached = []
    for name, module in model.named_modules():
        handle = module.__dict__.get("ct_decompress_hook")
        if handle is None:
            continue
        hook = module._forward_pre_hooks.get(handle.id)
        handle.remove()
        del module.ct_decompress_hook
        if hook is not None:
            module.ct_decompress_hook_fn = hook
        detached.append(name)
    return detached


def reattach_decompress_hook(model: nn.Module) -> list[str]:
    """Undo :func:`detach_decompress_hook`; return where hooks were put back."""
    restored = []
    for name, module in model.named_modules():
        hook = module.__dict__.pop("ct_decompress_hook_fn", None)
        if hook is not None:
            module.ct_decompress_hook = module.register_forward_pre_hook(hook)
            restored.append(name)
    return restored


def _format_name(module: nn.Module) -> str:
    scheme: Any = getattr(module, "quantization_scheme", None)
    fmt = getattr(scheme, "format", None)
    fmt = getattr(fmt, "value", fmt)
    if isinstance(fmt, str):
        return fmt
    # No recorded format: infer it from the parameters.
    packed, weight = _param(module, "weight_packed"), _param(module, "weight")
    if packed is not None:
        if packed.dtype == torch.int32:
            return "pack-quantized"
        return (
            "nvfp4-pack-quantized"
            if hasattr(module, "weight_global_scale")
            else "mxfp4-pack-quantized"
        )
    assert weight is not None
    if weight.dtype == torch.int8:
        return "int-quantized"
    scale = _param(module, "weight_scale")
    return (
        "mxfp8-quantized" if scale is not None and scale.dtype == torch.uint8 else "float-quantized"
    )


def _weight_args(module: nn.Module) -> Any:
    """The scheme's ``weights`` QuantizationArgs (num_bits, strategy, group_size...)."""
    scheme: Any = getattr(module, "quantization_scheme", None)
    return scheme.weights


def _shape(module: nn.Module) -> tuple[int, int]:
    shape = _param(module, "weight_shape")
    if shape is not None:
        return int(shape[0]), int(shape[1])
    m: Any = module
    return int(m.out_features), int(m.in_features)


def _group_size(args: Any, k: int) -> int:
    strategy = getattr(args.strategy, "value", args.strategy)
    if strategy in ("group", "tensor_group"):
        return int(args.group_size)
    if strategy in ("channel", "tensor"):
        return k
    raise NotImplementedError(
        f"compressed-tensors integer weights with strategy {strategy!r} are not adopted; "
        "supported: group, channel, tensor"
    )


def _per_row(scale: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """Scales as ``[N, G]``; a per-tensor scale is broadcast (a view, no copy)."""
    return scale.reshape(1, 1).expand(n, groups) if scale.numel() == 1 else scale


def _int_payload(module: nn.Module, packed: bool) -> QuantPayload:
    args = _weight_args(module)
    n, k = _shape(module)
    group = _group_size(args, k)
    scale = _per_row(_required(module, "weight_scale"), n, ceil_div(k, group))
    zero = _param(module, "weight_zero_point")
    if zero is not None and not bool(zero.any()):
        zero = None
    fmt = int_group_format(
        int(args.num_bits),
        group,
        zero_point="none" if zero is None else "int",
        scale_dtype=SCALE_DTYPE_NAMES[scale.dtype],
    )
    if packed:  # pack-quantized: the intgroup codec decodes compressed-tensors words itself
        payload = QuantPayload(
            format=fmt,
            data=_required(module, "weight_packed"),
            shape=(n, k),
            scales=scale,
            zeros=zero,
            layout={"packing": "compressed-tensors"},
        )
    else:  # int-quantized: int8 weight, W = (q - zp) * s, which is the qlens int8 layout
        if int(args.num_bits) != 8:
            raise NotImplementedError(
                f"int-quantized compressed-tensors weights of {args.num_bits} bits are not adopted"
            )
        payload = QuantPayload(
            format=fmt,
            data=_required(module, "weight"),
            shape=(n, k),
            scales=scale,
            zeros=None if zero is None else _per_row(zero, n, ceil_div(k, group)).to(torch.int8),
            layout={"packing": "qlens", "source": SOURCE},
        )
        validate_int_group(payload)
    return payload


def _fp8_payload(module: nn.Module) -> QuantPayload:
    args = _weight_args(module)
    weight, scale = _required(module, "weight"), _required(module, "weight_scale")
    n, k = weight.shape
    strategy = getattr(args.strategy, "value", args.strategy)
    if strategy == "tensor":
        block = None
    elif strategy == "channel":
        block = (1, k)
    elif strategy == "block":
        block = tuple(args.block_structure)
    elif strategy == "group":
        block = (1, int(args.group_size))
    else:
        raise NotImplementedError(f"compressed-tensors FP8 strategy {strategy!r} is not adopted")
    payload = fp8_payload(weight, scale, block)
    payload.layout["source"] = SOURCE
    return payload


@register_adopter(
    "compressed-tensors Linear before its first forward (pack-quantized, int-quantized, "
    "float-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp8-quantized)",
    _is_compressed,
)
def adopt_compressed_linear(module: nn.Module) -> QuantPayload:
    fmt = _format_name(module)
    source: dict[str, object] = {"source": SOURCE}
    if fmt == "pack-quantized":
        return _int_payload(module, packed=True)
    if (
        fmt in ("int-quantized", "naive-quantized")
        and _required(module, "weight").dtype == torch.int8
    ):
        return _int_payload(module, packed=False)
    if fmt in ("float-quantized", "naive-quantized"):
        return _fp8_payload(module)
    if fmt == "nvfp4-pack-quantized":
        return pack_nvfp4(
            _required(module, "weight_packed"),
            _required(module, "weight_scale"),
            _required(module, "weight_global_scale"),
            _shape(module),
            global_convention="divide",
            layout=source,
        )
    if fmt == "mxfp4-pack-quantized":
        return pack_mx(
            _required(module, "weight_packed"),
            _required(module, "weight_scale"),
            _shape(module),
            layout=source,
        )
    if fmt == "mxfp8-quantized":
        weight = _required(module, "weight")
        return pack_mx(
            weight, _required(module, "weight_scale"), tuple(weight.shape), layout=source
        )
    raise NotImplementedError(
        f"compressed-tensors format {fmt!r} is not adopted; supported: pack-quantized, "
        "int-quantized, float-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, "
        "mxfp8-quantized"
    )


def _asymmetric_packed_groups(config: Any) -> list[str]:
    """Config groups of a compressed-tensors ``quantization_config`` whose integer weights are
    packed (``pack-quantized``) with zero points."""
    qconfig = getattr(config, "quantization_config", None)
    if qconfig is not None and not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict() if hasattr(qconfig, "to_dict") else vars(qconfig)
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") != "compressed-tensors":
        return []
    groups = qconfig.get("config_groups") or {}
    found = []
    for name, group in groups.items():
        group = group if isinstance(group, dict) else vars(group)
        weights = group.get("weights") or {}
        weights = weights if isinstance(weights, dict) else vars(weights)
        fmt = group.get("format") or qconfig.get("format")
        if fmt == "pack-quantized" and weights.get("symmetric") is False:
            found.append(str(name))
    return found


def explain_load_failure(config: Any, error: Exception) -> Exception | None:
    """A clear error for a compressed-tensors checkpoint transformers failed to load, or None.

    Asymmetric pack-quantized checkpoints (``W4A16_ASYM``) store their zero points packed eight
    to an int32 (``[N/8, G]``), while the quantizer of transformers 5.24 with compressed-tensors
    0.20 allocates them unpacked (``[N, G]``) and refuses the size mismatch.
    """
    groups = _asymmetric_packed_groups(config)
    if not groups or "mismatched_sizes" not in str(error):
        return None
    return ValueError(
        "This compressed-tensors checkpoint holds asymmetric pack-quantized weights (config "
        f"groups {', '.join(groups)}, e.g. W4A16_ASYM), whose zero points are stored packed "
        "[out/8, groups]; the installed transformers/compressed-tensors allocate them unpacked "
        "[out, groups] and refuse the checkpoint (an upstream incompatibility, not a qlens "
        "limitation: the tensors are intact). Install a transformers/compressed-tensors pair "
        "that loads it, or quantize symmetrically (W4A16)."
    )
