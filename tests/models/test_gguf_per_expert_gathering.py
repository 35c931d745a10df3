"""``gather_per_expert_tensors`` on files of per-expert tensors written by gguf-py: complete
projections come back in layer, projection and expert order; the first incomplete one raises
naming exactly the tensors it lacks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from qlens.gguf_per_expert import gather_per_expert_tensors  # noqa: E402

PARTS = ("gate", "up", "down")
LAYERS = 3


def write_tensors(path: Path, names: list[str]) -> list[object]:
    """A GGUF file holding a small distinct float32 tensor for each name; its reader's tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for index, name in enumerate(names):
        writer.add_tensor(name, np.full((2, 32), index, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return list(gguf.GGUFReader(str(path)).tensors)


def expected_error(written: set[tuple[int, str, int]], experts: int) -> str | None:
    """The message's list of missing tensors for the first incomplete projection, if any."""
    for layer in sorted({layer for layer, _, _ in written}):
        for part in PARTS:
            missing = sorted(
                f"blk.{layer}.ffn_{part}.{e}.weight"
                for e in range(experts)
                if (layer, part, e) not in written
            )
            if missing:
                more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
                return ", ".join(missing[:6]) + more
    return None


@settings(max_examples=30, deadline=None)
@given(
    experts=st.integers(1, 9),
    data=st.data(),
)
def test_gathering_orders_complete_files_and_names_what_is_missing(experts, data):
    every = [(layer, part, e) for layer in range(LAYERS) for part in PARTS for e in range(experts)]
    complete = data.draw(st.booleans())
    written = set(every) if complete else set(data.draw(st.sets(st.sampled_from(every))))
    order = data.draw(st.permutations(sorted(written)))  # files need not list them in order
    names = [f"blk.{layer}.ffn_{part}.{e}.weight" for layer, part, e in order]
    with tempfile.TemporaryDirectory() as folder:
        tensors = write_tensors(Path(folder) / "experts.gguf", names)
        error = expected_error(written, experts)
        if error is not None:
            with pytest.raises(ValueError) as raised:
                gather_per_expert_tensors(tensors, experts, "experts.gguf")
            assert str(raised.value).startswith(f"experts.gguf lacks {error}: the file stores")
            return
        groups = gather_per_expert_tensors(tensors, experts, "experts.gguf")
        layers = sorted({layer for layer, _, _ in written})
        assert [(g.layer, g.part) for g in groups] == [(str(i), p) for i in layers for p in PARTS]
        for group in groups:
            assert [t.name for t in group.tensors] == [
                f"blk.{group.layer}.ffn_{group.part}.{e}.weight" for e in range(experts)
            ]
            assert group.shape.tolist() == [32, 2, experts]  # GGML order, experts last
            for tensor, data_of_expert in zip(group.tensors, group.expert_data, strict=True):
                assert np.array_equal(data_of_expert, np.full((2, 32), names.index(tensor.name)))
