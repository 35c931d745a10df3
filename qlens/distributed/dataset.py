"""Datasets for harvesting: read a file of examples; turn examples into padded token ids.

Files: ``.txt`` (one example per line), ``.jsonl`` (one JSON string, or object with a
``"text"`` field, per line) or ``.safetensors`` (an integer ``tokens`` tensor ``[example pos]``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from safetensors.torch import load_file
from torch import Tensor

from qlens.bridge.tokens import require_tokenizer, tokenize

Dataset = Sequence[str] | Tensor


def read_dataset(path: str | Path) -> list[str] | Tensor:
    """The examples stored in ``path`` (strings, or a token tensor for ``.safetensors``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        tensors = load_file(str(path))
        if "tokens" not in tensors:
            raise ValueError(
                f"{str(path)!r} holds {sorted(tensors)}; a token dataset needs a 'tokens' tensor "
                "[example pos]"
            )
        return tensors["tokens"]
    if suffix not in (".txt", ".jsonl"):
        raise ValueError(
            f"dataset file {str(path)!r}: use .txt (one example per line), .jsonl (a string or "
            "an object with a 'text' field per line) or .safetensors (a 'tokens' tensor)"
        )
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = _jsonl_text(line, path, number) if suffix == ".jsonl" else line
        if not text.strip():
            raise ValueError(
                f"{str(path)!r} line {number} is empty; every line must hold one example"
            )
        texts.append(text)
    if not texts:
        raise ValueError(f"dataset file {str(path)!r} holds no examples")
    return texts


def _jsonl_text(line: str, path: Path, number: int) -> str:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} line {number} is not JSON: {error}") from error
    if isinstance(record, dict):
        record = record.get("text")
    if not isinstance(record, str):
        raise ValueError(
            f"{str(path)!r} line {number}: expected a JSON string or an object with a string "
            "'text' field"
        )
    return record


def dataset_tokens(
    dataset: Dataset, tokenizer: Any, prepend_bos: bool | None = None
) -> tuple[Int[Tensor, "example pos"], Int[Tensor, "example pos"]]:
    """Token ids and attention mask (1 = real token) for the whole dataset.

    Strings are tokenized together and right-padded to the longest example, so every rank sees
    the same ``pos`` length whatever its shard; a token tensor is used as it is (mask all 1).
    Both come back on the CPU (the bridge moves each batch to the model).
    """
    if isinstance(dataset, Tensor):
        if dataset.dtype not in (torch.int64, torch.int32) or dataset.ndim != 2:
            raise TypeError(
                f"a token dataset must be an int64/int32 tensor [example pos], got "
                f"{dataset.dtype} of shape {tuple(dataset.shape)}"
            )
        if dataset.shape[0] == 0 or dataset.shape[1] == 0:
            raise ValueError(f"the token dataset is empty: shape {tuple(dataset.shape)}")
        tokens = dataset.to(device="cpu", dtype=torch.int64)
        return tokens, torch.ones_like(tokens)
    if isinstance(dataset, str) or not isinstance(dataset, Sequence):
        raise TypeError(
            f"dataset must be a list of strings or a token tensor [example pos], got "
            f"{type(dataset).__name__}"
        )
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    return tokenize(require_tokenizer(tokenizer), list(dataset), prepend_bos, "right")
