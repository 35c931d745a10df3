"""LogitLensTable: position / top-k selectors pick the displayed table; built from a bridge."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from links import kernel_links
from pngs import inline_pngs

from qlens.viz import LogitLensTable
from qlens.viz.arrays import decode_float16

WORDS = ["zero", "one", "two", "three", "four", "five"]
LAYERS = ["0_pre", "1_pre", "2_pre", "final_post"]


def _table(top_k: int = 3) -> tuple[LogitLensTable, torch.Tensor]:
    torch.manual_seed(1)
    logits = torch.randn(4, 3, len(WORDS)) * 3
    probs, ids = torch.softmax(logits, dim=-1).topk(5, dim=-1)
    top_tokens = [[[WORDS[i] for i in cell] for cell in row] for row in ids.tolist()]
    return LogitLensTable(probs, top_tokens, LAYERS, ["x", "y", "z"], top_k=top_k), logits


def test_rows_are_the_top_k_of_the_selected_position():
    table, logits = _table()
    probs = torch.softmax(logits, dim=-1)
    for position in (2, 0):
        table.position.value = position
        rows = table.displayed
        assert [label for label, _ in rows] == LAYERS
        for layer, (_, cells) in enumerate(rows):
            values, ids = probs[layer, position].sort(descending=True)
            assert [t for t, _ in cells] == [WORDS[i] for i in ids[:3]]
            assert [p for _, p in cells] == pytest.approx(values[:3].tolist(), abs=1e-6)
    table.top_k.value = 5
    assert all(len(cells) == 5 for _, cells in table.displayed)


def test_static_fallback_follows_the_selection_and_has_the_grid():
    table, _ = _table()
    first = table.to_html()
    table.position.value = 0
    html = table.to_html()
    assert html != first
    assert len(inline_pngs(html)) == 1
    assert "<table>" in html and "final_post" in html


def test_the_browser_gets_probabilities_and_token_indices_once():
    table, _ = _table()
    view = table.view
    assert view.layer_labels == LAYERS and view.tokens == ["x", "y", "z"] and view.n_ranks == 5
    probs = decode_float16(view.probs, (4, 3, 5))
    np.testing.assert_array_equal(probs, table.probs.numpy().astype(np.float16).astype(np.float32))
    ids = np.frombuffer(view.token_ids, dtype="<u4").reshape(4, 3, 5)
    strings = [[[view.vocab[i] for i in cell] for cell in row] for row in ids.tolist()]
    assert strings == table.top_tokens
    assert len(view.vocab) == len(set(view.vocab)) <= len(WORDS)
    assert kernel_links(table) == {
        "position": (table.position, "index"),
        "top_k": (table.top_k, "value"),
    }


def test_whitespace_and_byte_tokens_are_visible():
    probs = torch.tensor([[[0.6, 0.4]]])
    top = [[[" ", "\n"]]]
    table = LogitLensTable(probs, top, ["0"], ["\t"], top_k=2)
    assert table.view.vocab == ["␣", "⏎"] and table.view.tokens == ["⇥"]


def test_from_bridge_last_layer_matches_the_model_output(tiny_bridge):
    table = LogitLensTable.from_bridge(tiny_bridge, "a b c d a b c", top_k=2)
    logits = tiny_bridge("a b c d a b c")[0]
    assert table.layer_labels == ["0_pre", "1_pre", "final_post"]
    assert table.tokens == ["a", "b", "c", "d", "a", "b", "c"]
    for position in (6, 2):
        table.position.value = position
        final = dict(table.displayed)["final_post"]
        probs, ids = torch.softmax(logits[position], dim=-1).topk(2)
        assert [t for t, _ in final] == [tiny_bridge.tokenizer.decode([int(i)]) for i in ids]
        assert [p for _, p in final] == pytest.approx(probs.tolist(), abs=1e-5)


def test_bad_inputs_are_explained(tiny_bridge):
    probs = torch.zeros(4, 3, 2)
    top = [[["p", "q"]] * 3] * 4
    with pytest.raises(ValueError, match="got 2 layer labels for 4 layers"):
        LogitLensTable(probs, top, ["a", "b"], ["x", "y", "z"])
    with pytest.raises(ValueError, match="got 1 token labels for 3 positions"):
        LogitLensTable(probs, top, LAYERS, ["x"])
    with pytest.raises(ValueError, match=r"top_tokens must be nested \[layer\]\[pos\]\[rank\]"):
        LogitLensTable(probs, [[["p"]] * 3] * 4, LAYERS, ["x", "y", "z"])
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 2\], got 3"):
        LogitLensTable(probs, top, LAYERS, ["x", "y", "z"], top_k=3)
    with pytest.raises(ValueError, match="the logit lens takes one sequence"):
        LogitLensTable.from_bridge(tiny_bridge, tiny_bridge.to_tokens(["a b", "c d"]))
