"""Read a safetensors file tensor by tensor into memory of each tensor's own, without a memory map.

safetensors' ``safe_open`` maps the whole file, and every page read through the map stays
resident (counted in the process' RSS) while any tensor read from it is alive. Streaming loads
read each tensor with plain file reads instead: the file's pages stay in the page cache only,
and a tensor's memory is freed as soon as the tensor is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 * 2**20  # safetensors' own cap on the JSON header


def read_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in the file, in the order of their bytes, each read
    into a new CPU tensor (little-endian hosts, as safetensors itself assumes)."""
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        if not 0 < size <= _HEADER_LIMIT:
            raise ValueError(f"{path} is not a safetensors file (header size {size})")
        header = json.loads(file.read(size))
        header.pop("__metadata__", None)
        start = 8 + size
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(
                    f"{path}: tensor {name!r} has dtype {info['dtype']}, which qlens does not "
                    f"read; known: {sorted(_DTYPES)}"
                )
            begin, end = (int(o) for o in info["data_offsets"])
            data = torch.empty(end - begin, dtype=torch.uint8)
            target: Any = data.numpy()  # a writable buffer over the tensor's memory
            file.seek(start + begin)
            if end > begin and file.readinto(target) != end - begin:
                raise ValueError(f"{path} ends inside tensor {name!r}: the file is truncated")
            yield name, data.view(dtype).reshape(info["shape"])
