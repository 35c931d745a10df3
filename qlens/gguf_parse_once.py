"""Each GGUF file parsed once, and gguf-py's tensor-name map built once, during a load.

transformers parses a GGUF file from the start for its config, for its tokenizer and for its
weights (every metadata field, a 49k-token vocabulary included: about 9 s a parse of the
embedded SmolLM2 file on 2 CPU cores), and ``get_gguf_hf_weights_map`` builds gguf-py's
tensor-name map again for each of the model's hundreds of submodules (tens of milliseconds each).
Inside :func:`gguf_parsed_once` both are kept: a file read in mode ``"r"`` gets the reader made
by its first parse, and the name map of an (architecture, layer count) is built once. Both are
only read by their users. Leaving the block restores gguf-py's own functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any, Literal


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Share GGUF readers (per file, mode ``"r"``) and tensor-name maps inside the block."""
    import gguf

    build_name_map, reader_class = gguf.get_tensor_name_map, gguf.GGUFReader
    readers: dict[str, Any] = {}

    def shared_reader(path: Any, mode: Literal["r", "r+", "c"] = "r") -> Any:
        if mode != "r":
            return reader_class(path, mode)
        key = os.path.realpath(os.fspath(path))
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build_name_map)
    gguf.GGUFReader = shared_reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = build_name_map, reader_class  # type: ignore[misc]
