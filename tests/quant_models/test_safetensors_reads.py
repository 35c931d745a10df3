"""qlens' map-free safetensors reader against safetensors' own ``load_file``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlens.safetensors_reads import read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=gen)
    return {
        "z.bf16": floats.bfloat16(),
        "a.f16": floats.half(),
        "m.f32": floats,
        "f64": floats.double(),
        "fp8": floats.to(torch.float8_e4m3fn),
        "fp8_e5m2": floats.to(torch.float8_e5m2),
        "i64": torch.arange(-4, 4),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([[0, 255]], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_reads_every_tensor_exactly_as_safetensors_does(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    read = dict(read_safetensors(path))
    assert read.keys() == expected.keys()
    for name, value in expected.items():
        got = read[name]
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert torch.equal(
            got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
        ), name
    # each tensor owns its memory: writing to one changes no other and not the file
    read["m.f32"].fill_(0)
    assert torch.equal(load_file(str(path))["m.f32"], expected["m.f32"])


def _raw_file(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def test_bad_files_raise_saying_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    _raw_file(path, {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"tensor 'x' has dtype C64, which qlens does not read"):
        list(read_safetensors(path))
    _raw_file(path, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(12))
    with pytest.raises(ValueError, match=r"ends inside tensor 'x': the file is truncated"):
        list(read_safetensors(path))
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        list(read_safetensors(path))
