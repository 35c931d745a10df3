"""Loading a GGUF file parses it once and builds gguf-py's tensor-name map once; gguf-py's own
functions are back after the load, also when it raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import make_gguf_llama, write_gguf_llama  # noqa: E402
from model_fixtures import make_tiny_tokenizer  # noqa: E402

import qlens  # noqa: E402
from qlens.gguf_parse_once import gguf_parsed_once  # noqa: E402


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """gguf-py's reader and name-map builder, counting their calls."""
    calls: dict[str, list] = {"parses": [], "name_maps": []}
    reader_class, build_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class CountingReader(reader_class):  # type: ignore[misc, valid-type]
        def __init__(self, path, mode="r"):  # noqa: ANN001
            calls["parses"].append((str(path), mode))
            super().__init__(path, mode)

    def counting_name_map(*args):  # noqa: ANN002, ANN202
        calls["name_maps"].append(args)
        return build_name_map(*args)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_name_map)
    return calls


def test_a_load_parses_the_file_once_and_builds_one_name_map(tmp_path: Path, counted) -> None:
    path = write_gguf_llama(make_gguf_llama(), tmp_path / "tiny.gguf", lambda _: "Q8_0")
    reader_before, name_map_before = gguf.GGUFReader, gguf.get_tensor_name_map
    bridge = qlens.load(path, tokenizer=make_tiny_tokenizer())
    assert counted["parses"] == [(str(path), "r")]  # qlens' reader and transformers' config
    assert len(counted["name_maps"]) == 1  # one per submodule without the block
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_before, name_map_before)
    assert bridge(torch.tensor([[1, 2, 3]])).isfinite().all()


def test_the_block_restores_gguf_py_when_it_raises(tmp_path: Path, counted) -> None:
    path = write_gguf_llama(make_gguf_llama(), tmp_path / "tiny.gguf", lambda _: "Q8_0")
    reader_before = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="inside"), gguf_parsed_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and len(counted["parses"]) == 1
        assert gguf.GGUFReader(path, "r+") is not first  # other modes are not shared
        raise RuntimeError("inside")
    assert gguf.GGUFReader is reader_before
    assert gguf.GGUFReader(path) is not first  # no reader outlives the block
