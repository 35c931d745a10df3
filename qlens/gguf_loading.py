"""Load a ``.gguf`` file with its quantized weights kept as GGUF blocks in qlens modules.

Llama-architecture files (Llama, SmolLM, Mistral...; Mixtral, written as ``llama`` with experts,
``qlens.gguf_mixtral``), Qwen2-MoE / Qwen3-MoE files and architectures transformers reads
without a special tensor processor (Qwen2, Qwen3...) are read by qlens: the model is built on
the meta device, transformers' GGUF-to-HF name map places each tensor, every quantized linear
of a type qlens decodes becomes a ``QuantLinear`` over a GGUF payload (Llama's q/k rows put
back in HF order exactly as transformers does: GGUF blocks run along K, so permuting rows moves
whole rows of blocks), each MoE layer's experts a ``QuantExperts`` (``qlens.gguf_experts``;
stacked, or one tensor per expert in older Mixtral files: ``qlens.gguf_per_expert``), and the
rest (embeddings, norms, routers, types qlens has no codec for) is dequantized by gguf-py into
float. Other architectures (GPT-OSS and MiniMax experts, Bloom/GPT-2 reshapes...) go through
transformers' own GGUF loader; where it keeps blocks packed (``GgufLinear`` / ``GgufExperts``,
qwen35/lfm2 in transformers 5.x) qlens lends it a kernel computed by qlens' codecs and then
swaps those modules for qlens ``QuantLinear`` / ``QuantExperts``; elsewhere transformers
dequantizes, which is logged.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


class QlensGgufKernel:
    """transformers' GGUF kernel interface, computed by qlens' codecs (float32 math)."""

    @staticmethod
    def supports(ggml_type: int) -> bool:
        from qlens.quant.codecs.gguf import GGML_TYPES

        return ggml_type in GGML_TYPES

    @staticmethod
    def dequantize(
        weight: Tensor, ggml_type: int, rows: int, cols: int, dtype: torch.dtype
    ) -> Tensor:
        from qlens.quant.codecs.gguf import dequantize_gguf_rows, ggml_type_by_id

        values = dequantize_gguf_rows(weight, ggml_type_by_id(ggml_type))
        return values.reshape(rows, cols).to(dtype)

    @classmethod
    def get_rows(
        cls, weight: Tensor, indices: Tensor, ggml_type: int, cols: int, dtype: torch.dtype
    ) -> Tensor:
        rows = weight.index_select(0, indices)
        return cls.dequantize(rows, ggml_type, rows.shape[0], cols, dtype)

    @classmethod
    def mul_mat_vec(cls, weight: Tensor, x: Tensor, ggml_type: int, out_features: int) -> Tensor:
        full = cls.dequantize(weight, ggml_type, out_features, x.shape[-1], torch.float32)
        return x.float() @ full.T

    @staticmethod
    def mul_mat_id(*args: Any) -> Tensor:
        raise NotImplementedError(
            "GGUF experts loaded by qlens run as qlens QuantExperts; this GgufExperts module was "
            "not converted (load the file with qlens.load)"
        )


@contextlib.contextmanager
def _lent_kernel() -> Iterator[None]:
    """transformers' GGUF loader sees qlens' kernel for the duration of one load."""
    from transformers.integrations.gguf import kernels

    previous = kernels._gguf_kernel
    kernels._gguf_kernel = QlensGgufKernel()  # type: ignore[assignment]
    try:
        yield
    finally:
        kernels._gguf_kernel = previous


def load_gguf_packed(
    path: Path, *, dtype: torch.dtype, device: str | torch.device | None
) -> nn.Module:
    """The causal LM in the GGUF file ``path``, quantized linears kept as GGUF payloads."""
    from qlens.gguf_parse_once import gguf_parsed_once

    with gguf_parsed_once():
        return _load_gguf_packed(path, dtype, device)


def _load_gguf_packed(
    path: Path, dtype: torch.dtype, device: str | torch.device | None
) -> nn.Module:
    from gguf import GGUFReader

    from qlens.gguf_metadata import text_field

    reader = GGUFReader(str(path))
    architecture = text_field(reader, "general.architecture")
    if architecture is None:
        raise ValueError(
            f"{path.name} has no general.architecture in its metadata, so it names no model; "
            "qlens loads GGUF files of models (as llama.cpp's converter writes them)"
        )
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    # transformers' block-keeping reader, or its legacy one with a tensor processor qlens does not
    # reproduce (GPT-OSS and MiniMax experts, Bloom/GPT-2 reshapes...): transformers reads those.
    processor = TENSOR_PROCESSORS.get(architecture)
    own = processor is None or processor.__name__ == _REPRODUCED_PROCESSORS.get(architecture)
    if own and not is_gguf_arch_supported(architecture):
        model = _load_with_qlens_reader(path, reader, architecture, dtype)
    else:
        model = _load_with_transformers(path, dtype)
    if device is not None:
        model.to(device)
    return model.eval()


# Architectures whose transformers tensor processor qlens reproduces on packed blocks: Llama's
# q/k row permutation, Qwen2-MoE/Qwen3-MoE's gate|up stacking of the experts (qlens.gguf_experts).
# Architectures without a processor (Qwen2/3, Mistral...) are read by qlens too.
_REPRODUCED_PROCESSORS = {
    "llama": "LlamaTensorProcessor",
    "qwen2moe": "Qwen2MoeTensorProcessor",
    "qwen3moe": "Qwen2MoeTensorProcessor",
}


def _load_with_transformers(path: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' loader with qlens' kernel lent (packed where transformers keeps blocks)."""
    from transformers import AutoModelForCausalLM

    with _lent_kernel():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=dtype,
            attn_implementation="sdpa",  # else transformers fetches a ggml attention kernel
            local_files_only=True,
        )
    swapped = to_qlens_modules(model)
    if not swapped:
        logger.warning(
            "transformers dequantized %s while loading it (it keeps GGUF blocks packed only for "
            "some architectures); the model holds float weights",
            path.name,
        )
    return model


def _load_with_qlens_reader(
    path: Path, reader: Any, architecture: str, dtype: torch.dtype
) -> nn.Module:
    """Build the model on meta and fill it from the file: linears as GGUF payloads."""
    import numpy as np
    from accelerate import init_empty_weights
    from gguf import dequantize as gguf_dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from qlens.gguf_experts import MOE_SIZE_NAMES, expert_tensor_base, place_experts
    from qlens.gguf_metadata import set_expert_widths
    from qlens.gguf_mixtral import (
        MIXTRAL_SIZE_NAMES,
        is_mixtral_file,
        mixtral_config,
        mixtral_tensor_names,
    )
    from qlens.gguf_per_expert import PER_EXPERT_TENSOR, gather_per_expert_tensors
    from qlens.load_checks import key_list
    from qlens.modules import QuantLinear
    from qlens.quant.adopt.higgs_gguf import gguf_payload
    from qlens.quant.codecs.gguf import GGML_TYPES
    from qlens.quantize_on_load import put_tensor

    mixtral = is_mixtral_file(reader)
    if mixtral:
        config = mixtral_config(path, reader)
    else:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        set_expert_widths(config, reader, architecture)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    if mixtral:
        names = mixtral_tensor_names(model, processor)
    else:
        names = get_gguf_hf_weights_map(model, processor)
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    expected = set(shapes)
    loaded: set[str] = set()
    experts: dict[str, list[Any]] = {}
    per_expert: list[Any] = []  # a Mixtral file from before llama.cpp stacked experts
    for tensor in reader.tensors:
        if PER_EXPERT_TENSOR.fullmatch(tensor.name):
            if not mixtral:
                raise _no_experts_module(tensor.name, path, architecture)
            per_expert.append(tensor)
            continue
        experts_base = expert_tensor_base(tensor.name)
        if experts_base is not None:
            key = _experts_key(names, experts_base, tensor.name, path, architecture)
            experts.setdefault(key.rpartition(".")[0], []).append(tensor)
            continue
        if tensor.name not in names:
            continue
        key = names[tensor.name]
        owner_name, _, leaf = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        type_id = int(tensor.tensor_type)
        if type_id in GGML_TYPES and type(owner) is nn.Linear and leaf == "weight":
            *lead, cols = reversed(tensor.shape.tolist())  # a [1, H] gate may be stored as [H]
            _require_shape(path, tensor.name, key, (math.prod(lead), cols), shapes[key])
            rows = np.asarray(tensor.data).reshape(owner.out_features, -1)
            rows = processor.process(weights=rows, name=tensor.name).weights  # q/k row order
            rows = rows.reshape(owner.out_features, -1)  # Qwen2-MoE's [1, H] shared-expert gate
            payload = gguf_payload(torch.from_numpy(np.array(rows, copy=True)), type_id)
            bias: Tensor | None = owner.bias
            if bias is not None and bias.is_meta:  # its tensor comes later and replaces this
                bias = torch.zeros(bias.shape, dtype=dtype)
            model.set_submodule(owner_name, QuantLinear(payload, bias))
        else:
            values = gguf_dequantize(tensor.data, tensor.tensor_type)
            values = processor.process(weights=values, name=tensor.name).weights
            _require_shape(path, tensor.name, key, values.shape, shapes[key])
            value = torch.from_numpy(np.copy(values)).to(dtype)
            put_tensor(model, key, value)
        loaded.add(key)
    if per_expert:
        for group in gather_per_expert_tensors(per_expert, config.num_local_experts, path.name):
            key = _experts_key(names, group.stacked_base, group.name, path, architecture)
            experts.setdefault(key.rpartition(".")[0], []).append(group)
    size_names = MIXTRAL_SIZE_NAMES if mixtral else MOE_SIZE_NAMES
    for module_name, tensors in experts.items():
        place_experts(
            model, module_name, tensors, activation=str(config.hidden_act), dtype=dtype,
            file_name=path.name, size_names=size_names,
        )  # fmt: skip
        loaded.update(f"{module_name}.{leaf}" for leaf in ("gate_up_proj", "down_proj"))
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target not in loaded and source in loaded:
            put_tensor(model, target, model.get_parameter(source))
            loaded.add(target)
    left = sorted(expected - loaded)
    if left:
        raise ValueError(
            f"{path.name} lacks tensors for {key_list(left)}; qlens does not fill weights with "
            "random values."
        )
    return model


def _require_shape(
    path: Path, tensor_name: str, key: str, shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    if tuple(int(s) for s in shape) != tuple(expected):
        raise ValueError(
            f"{path.name}: {tensor_name} holds a {list(shape)} weight, but {key} of the model "
            f"built from the file's config is {list(expected)}; the file does not match the "
            "config read from its metadata"
        )


def _experts_key(
    names: dict[str, str], base: str, tensor_name: str, path: Path, architecture: str
) -> str:
    """The fused experts parameter transformers' name map gives a stacked expert tensor."""
    key = names.get(base)
    if key is None:
        raise _no_experts_module(tensor_name, path, architecture)
    return key


def _no_experts_module(tensor_name: str, path: Path, architecture: str) -> ValueError:
    why = (
        " (a Mixtral file says how many experts it has in llama.expert_count, which this "
        "file lacks or sets to 0)"
        if architecture == "llama"
        else ""
    )
    return ValueError(
        f"{path.name} holds expert tensors ({tensor_name}), but the {architecture!r} model built "
        f"from its metadata has no experts module for them{why}; qlens cannot load it. Convert "
        "the original checkpoint again."
    )


def to_qlens_modules(model: nn.Module) -> int:
    """Swap transformers' GgufLinear / GgufExperts for qlens modules; return how many."""
    from qlens.modules import ExpertGate, QuantExperts, QuantLinear
    from qlens.quant.adopt.higgs_gguf import adopt_gguf, adopt_gguf_experts

    act = getattr(getattr(model, "config", None), "hidden_act", None)
    count = 0
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind == "GgufLinear":
            bias = getattr(module, "bias", None)
            new: nn.Module = QuantLinear(adopt_gguf(module), bias)
        elif kind == "GgufExperts":
            if act is None:
                raise ValueError(
                    f"{name}: the model's config names no hidden_act, so qlens cannot run its "
                    "GGUF experts; load the file with transformers instead"
                )
            payloads = adopt_gguf_experts(module)
            new = QuantExperts(
                payloads["gate_up_proj"], payloads["down_proj"], ExpertGate("stacked", str(act))
            )
        else:
            continue
        model.set_submodule(name, new)
        count += 1
    return count
