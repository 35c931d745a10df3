"""`qlens.load`: one entry point from "a model" (default, directory, hub id, loaded model) to a Bridge."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from qlens.bridge import Bridge
from qlens.load_checks import dequantized_model, require_complete_load
from qlens.models import default_model_dir
from qlens.quant.guards import quantization_method

ModelSource = str | os.PathLike | torch.nn.Module | tuple | None
TokenizerSource = str | os.PathLike | PreTrainedTokenizerBase | None

# Files whose presence means a directory holds a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# from_pretrained arguments that say where files come from; config and tokenizer loads need them too.
_HUB_KEYS = ("local_files_only", "revision", "token", "cache_dir")
# Written by qlens.save_quantized next to its weights (qlens.modules.serialization.MANIFEST_FILE).
_QLENS_MANIFEST = "qlens_quantized.json"
_CAUSAL_LM_CLASS_NAMES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def load(
    model: ModelSource = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    tokenizer: TokenizerSource = None,
    trust_remote_code: bool = False,
    dequantize: bool = False,
    quantize: str | None = None,
    **from_pretrained_kwargs: Any,
) -> Bridge:
    """Load a causal LM and wrap it in a `Bridge`.

    `model` may be:
      * nothing: the embedded SmolLM2-135M-Instruct (converted once into qlens' cache);
      * a local model directory (config.json plus safetensors weights);
      * a Hugging Face hub id, read from the local hub cache (pass `local_files_only=False` to
        allow downloading);
      * an already-loaded `PreTrainedModel` (quantized or dispatched with `device_map` included),
        wrapped as it is: never moved, cast or copied;
      * a `(model, tokenizer)` pair;
      * a directory written by `qlens.save_quantized` (reloaded exactly by `load_quantized`).

    `dtype=None` loads unquantized checkpoints in float32, which makes CPU analysis exact (bf16
    weights widen losslessly); quantized checkpoints keep the dtype their quantizer chooses. Pass
    `dtype="auto"` to keep the checkpoint's dtype. `device` places the weights (default: CPU).
    Loading is safe by default: safetensors only (`use_safetensors=False` allows pickled weights,
    read with `weights_only=True`) and no remote code unless `trust_remote_code=True`. Remaining
    keyword arguments go to `AutoModelForCausalLM.from_pretrained`.

    `dequantize=True` loads a quantized checkpoint as a float model: every quantized linear
    becomes an `nn.Linear` (quantized experts: the family's float experts) holding the exact
    dequantized weights in `dtype` (default float32). `quantize="int4"` (any scheme of
    `qlens.quantize`) quantizes a float checkpoint while loading it, one tensor at a time, so the
    float model is never held whole; the result equals `qlens.quantize(qlens.load(path), scheme)`.
    A checkpoint whose tensors do not match its model (missing or unexpected keys) raises: qlens
    never returns randomly initialised weights.
    """
    if isinstance(model, tuple):
        if len(model) != 2:
            raise TypeError(
                f"load() takes a (model, tokenizer) pair, got a tuple of {len(model)} items."
            )
        if tokenizer is not None:
            raise TypeError(
                "Pass the tokenizer either inside the (model, tokenizer) pair or as tokenizer=, not both."
            )
        model, tokenizer = model
    if dequantize and quantize is not None:
        raise TypeError("Pass either dequantize=True or quantize=scheme, not both.")
    if isinstance(model, PreTrainedModel):
        options = dict(from_pretrained_kwargs)
        options.update({"dequantize": True} if dequantize else {})
        options.update({"quantize": quantize} if quantize is not None else {})
        return _wrap_loaded(model, tokenizer, dtype, device, options)
    if isinstance(model, torch.nn.Module):
        raise TypeError(
            f"load() wraps Hugging Face models (transformers.PreTrainedModel); got "
            f"{type(model).__qualname__}. Load it with AutoModelForCausalLM.from_pretrained first."
        )
    if model is None:
        model = default_model_dir()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            "load() takes nothing, a model directory, a hub id, a PreTrainedModel or a "
            f"(model, tokenizer) pair; got {type(model).__qualname__}."
        )
    request = _Request(dtype, device, trust_remote_code, dequantize, quantize)
    return _load_from_source(os.fspath(model), request, tokenizer, from_pretrained_kwargs)


@dataclass(frozen=True)
class _Request:
    """How to load: what `load` was asked for besides the source and the tokenizer."""

    dtype: torch.dtype | str | None
    device: str | torch.device | None
    trust_remote_code: bool
    dequantize: bool
    quantize: str | None


def _load_from_source(
    source: str, request: _Request, tokenizer: TokenizerSource, kwargs: dict[str, Any]
) -> Bridge:
    trust_remote_code = request.trust_remote_code
    kwargs.setdefault("use_safetensors", True)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from qlens.gguf_parse_once import gguf_parsed_once

        with gguf_parsed_once():  # the model, its config and its tokenizer read one parse
            hf_model = _load_gguf(path, request, kwargs)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(
                    str(path.parent), gguf_file=path.name, local_files_only=True
                )
        return _bridge(hf_model, tokenizer, trust_remote_code)
    location = _resolve_location(source, kwargs)
    if (Path(location) / _QLENS_MANIFEST).is_file():
        hf_model = _load_saved_quantized(location, request, kwargs)
    else:
        hf_model = _load_checkpoint(location, request, kwargs)
    if tokenizer is None:
        tokenizer = _find_tokenizer(location, trust_remote_code, kwargs)
    return _bridge(hf_model, tokenizer, trust_remote_code)


def _bridge(hf_model: Any, tokenizer: TokenizerSource, trust_remote_code: bool) -> Bridge:
    hf_model.eval()
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(
            os.fspath(tokenizer), trust_remote_code=trust_remote_code
        )
    return Bridge(hf_model, tokenizer=tokenizer)


def _load_gguf(path: Path, request: _Request, kwargs: dict[str, Any]) -> Any:
    """A GGUF file: quantized tensors stay GGUF payloads (dequantize=True: a float model)."""
    given = sorted(k for k in kwargs if k != "use_safetensors")
    if request.quantize is not None:
        given.append("quantize")
    if given:
        raise TypeError(
            f"{str(path)!r} is a GGUF file, which qlens loads with dtype=, device= and "
            f"dequantize= only; {', '.join(given)} cannot be applied to it."
        )
    from qlens.gguf_loading import load_gguf_packed
    from qlens.gguf_mixtral import is_mixtral_gguf

    dtype = _as_dtype(request.dtype if request.dtype not in (None, "auto") else torch.float32)
    if request.dequantize and is_mixtral_gguf(path):  # transformers reads it as a dense Llama
        return dequantized_model(load_gguf_packed(path, dtype=dtype, device=request.device), dtype)
    if request.dequantize:
        from transformers import GgufConfig

        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=dtype,
            device_map=request.device,
            local_files_only=True,
        )
        return dequantized_model(model, dtype)
    return load_gguf_packed(path, dtype=dtype, device=request.device)


def _load_checkpoint(location: str, request: _Request, kwargs: dict[str, Any]) -> Any:
    config = _read_config(location, request.trust_remote_code, kwargs)
    _require_causal_lm_config(config, location)
    _require_safetensors_unless_allowed(location, kwargs)
    quantized = getattr(config, "quantization_config", None) is not None
    dtype = request.dtype
    if dtype is None:
        dtype = "auto" if quantized and not request.dequantize else torch.float32
    if request.device is not None and "device_map" in kwargs:
        raise TypeError("Pass either device= or device_map=, not both.")
    if request.quantize is not None:
        return _quantize_while_loading(location, config, request.quantize, request, dtype, kwargs)
    from qlens.packed_load import packs_on_load

    if quantized and packs_on_load(config):
        return _load_packed(location, config, request, dtype, kwargs)
    if request.device is not None:
        kwargs["device_map"] = request.device
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            location,
            dtype="auto" if request.dequantize and quantized else dtype,
            trust_remote_code=request.trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
    except RuntimeError as error:
        from qlens.quant.adopt.compressed_tensors import explain_load_failure

        explained = explain_load_failure(config, error)
        if explained is None:
            raise
        raise explained from error
    hf_model, info = loaded
    if quantized:
        from qlens.quant.adopt.ct_experts import check_fused_experts

        # Names the experts whose values differ from the checkpoint's before the generic check
        # refuses float experts of a quantized checkpoint.
        check_fused_experts(hf_model, location)
    require_complete_load(hf_model, info, location)
    if request.dequantize:
        return dequantized_model(hf_model, _as_dtype(dtype))
    return hf_model


def _quantize_while_loading(
    location: str,
    config: Any,
    scheme: str,
    request: _Request,
    dtype: Any,
    kwargs: dict[str, Any],
) -> Any:
    _require_local_streaming(location, kwargs, "float checkpoints for quantize=")
    from qlens.quantize_on_load import load_quantizing

    device = torch.device(request.device if request.device is not None else "cpu")
    return load_quantizing(location, config, scheme, dtype=_as_dtype(dtype), device=device)


def _load_packed(
    location: str, config: Any, request: _Request, dtype: Any, kwargs: dict[str, Any]
) -> Any:
    """FP8-block / GPT-OSS MXFP4 checkpoints, kept packed (transformers would dequantize them)."""
    from qlens.packed_load import load_packed

    _require_local_streaming(location, kwargs, f"{quantization_method(config)} checkpoints")
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    device = torch.device(request.device if request.device is not None else "cpu")
    model = load_packed(location, config, dtype=_as_dtype(dtype), device=device)
    return dequantized_model(model, _as_dtype(dtype)) if request.dequantize else model


def _require_local_streaming(location: str, kwargs: dict[str, Any], what: str) -> None:
    ignored = sorted(set(kwargs) - {"use_safetensors", *_HUB_KEYS})
    if ignored or not Path(location).is_dir():
        raise TypeError(
            f"qlens streams {what} from a local model directory of safetensors shards and takes "
            f"dtype= and device= only; got {location!r} with {', '.join(ignored) or 'a hub id'}."
        )


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"dtype {dtype!r} is not a floating torch dtype; pass e.g. torch.float32 or 'bfloat16'"
        )
    return value


def _load_saved_quantized(location: str, request: _Request, kwargs: dict[str, Any]) -> Any:
    """A directory written by qlens.save_quantized: its payloads reload exactly."""
    given = sorted(k for k in kwargs if k != "use_safetensors")
    given += [n for n, v in (("dtype", request.dtype), ("quantize", request.quantize)) if v]
    if given:
        raise TypeError(
            f"{location!r} was written by qlens.save_quantized and reloads exactly as saved, so "
            f"{', '.join(given)} cannot be applied. Pass device= (and dequantize=True for a "
            "float copy) only, or cast the loaded model yourself."
        )
    from qlens.modules.serialization import load_quantized

    model = load_quantized(location, device=request.device or "cpu")
    if request.dequantize:
        return dequantized_model(model, torch.float32)
    return model


def _resolve_location(source: str, kwargs: dict[str, Any]) -> str:
    """A local directory, or a hub id to read from the local cache unless downloading is allowed."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(
                f"{source!r} is a file, not a model directory or a .gguf file. Pass the "
                "directory that holds config.json and the weights, or a GGUF file."
            )
        if not (path / "config.json").is_file():
            raise ValueError(
                f"The directory {str(path)!r} has no config.json, so it is not a Hugging Face "
                "model directory. Pass the directory that holds config.json and the weights "
                "(*.safetensors), e.g. one written by model.save_pretrained()."
            )
        return str(path)
    if _looks_like_path(source):
        raise FileNotFoundError(
            f"Model path {source!r} does not exist. Pass an existing model directory, a hub id "
            "such as 'HuggingFaceTB/SmolLM2-135M', or nothing for the embedded default model."
        )
    kwargs.setdefault("local_files_only", True)
    return source


def _looks_like_path(source: str) -> bool:
    parts = source.replace("\\", "/").split("/")
    return (
        os.path.isabs(source)
        or source.startswith(("~", "."))
        or len(parts) > 2
        or any(part in ("", ".", "..") for part in parts)
    )


def _read_config(
    location: str, trust_remote_code: bool, kwargs: dict[str, Any]
) -> PretrainedConfig:
    config_kwargs = _hub_kwargs(kwargs)
    try:
        return AutoConfig.from_pretrained(
            location, trust_remote_code=trust_remote_code, **config_kwargs
        )
    except OSError as error:
        if Path(location).is_dir() or not kwargs.get("local_files_only"):
            raise
        raise FileNotFoundError(
            f"{location!r} is neither a local directory nor a model in the local Hugging Face "
            "cache. Pass the path of a downloaded model directory, or local_files_only=False to "
            "download it from the hub."
        ) from error


def _require_safetensors_unless_allowed(location: str, kwargs: dict[str, Any]) -> None:
    directory = Path(location)
    if not kwargs["use_safetensors"] or not directory.is_dir():
        return
    if any(directory.glob("*.safetensors*")):
        return
    pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(
        p.name for p in directory.glob("*.pt")
    )
    if pickled:
        raise ValueError(
            f"The directory {location!r} holds only pickled weights ({', '.join(pickled[:3])}); "
            "qlens reads safetensors by default. Pass use_safetensors=False to read them "
            "(transformers then loads them with torch.load(weights_only=True))."
        )


def _hub_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {key: kwargs[key] for key in _HUB_KEYS if key in kwargs}


def _require_causal_lm_config(config: PretrainedConfig, location: str) -> None:
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures:
        causal = any(_is_causal_lm_class_name(name) for name in architectures)
    else:
        causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not causal:
        described = ", ".join(architectures) or f"model_type {config.model_type!r}"
        raise ValueError(
            f"{location!r} holds a {described} model, which is not a causal language model. "
            "qlens analyses decoder-only LMs that AutoModelForCausalLM can load "
            "(e.g. Llama, Qwen, Gemma, GPT-2)."
        )


def _is_causal_lm_class_name(name: str) -> bool:
    return name in _CAUSAL_LM_CLASS_NAMES or name.endswith(("ForCausalLM", "LMHeadModel"))


def _find_tokenizer(
    location: str, trust_remote_code: bool, kwargs: dict[str, Any]
) -> PreTrainedTokenizerBase | None:
    """The tokenizer stored with the model; None for a local directory that has none."""
    if Path(location).is_dir() and not any(
        (Path(location) / name).is_file() for name in _TOKENIZER_FILES
    ):
        return None
    hub_kwargs = _hub_kwargs(kwargs)
    return AutoTokenizer.from_pretrained(
        location, trust_remote_code=trust_remote_code, **hub_kwargs
    )


def _wrap_loaded(
    model: PreTrainedModel,
    tokenizer: TokenizerSource,
    dtype: torch.dtype | str | None,
    device: str | torch.device | None,
    kwargs: dict[str, Any],
) -> Bridge:
    """Wrap an already-loaded model in place: no move, no cast, no copy."""
    given = [name for name, value in (("dtype", dtype), ("device", device)) if value is not None]
    given += sorted(kwargs)
    if given:
        raise TypeError(
            f"load() wraps an already-loaded model as it is, so {', '.join(given)} cannot be "
            "applied. Move or cast the model yourself first (e.g. model.to(...)), then call load()."
        )
    if not any(_is_causal_lm_class_name(cls.__name__) for cls in type(model).__mro__):
        raise ValueError(
            f"{type(model).__name__} is not a causal language model. qlens analyses decoder-only "
            "LMs with a language-model head (classes such as LlamaForCausalLM)."
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    elif tokenizer is None:
        tokenizer = _tokenizer_of_loaded(model)
    return Bridge(model, tokenizer=tokenizer)


def _tokenizer_of_loaded(model: PreTrainedModel) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved next to a loaded model's checkpoint, if there is one on disk."""
    origin = getattr(model, "name_or_path", "") or ""
    if not origin:
        return None
    if Path(origin).is_dir():
        return _find_tokenizer(origin, trust_remote_code=False, kwargs={})
    try:
        return AutoTokenizer.from_pretrained(origin, local_files_only=True)
    except OSError:
        warnings.warn(
            f"No tokenizer for {origin!r} in the local Hugging Face cache; the bridge accepts "
            "token ids only. Pass tokenizer= to use text.",
            stacklevel=3,
        )
        return None
