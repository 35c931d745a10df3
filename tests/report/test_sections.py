"""Pieces of the report that need no model: head selection, HTML tables, figure files."""

from __future__ import annotations

import torch

from qlens.report.build import Report, Section
from qlens.report.heads import found_heads, top_heads
from qlens.report.lens_drift import layer_logit_kl
from qlens.report.page import table

PNG = b"\x89PNG\r\n\x1a\nrest"


def test_found_and_top_heads_are_ranked_by_score():
    scores = torch.tensor([[0.1, 0.9, 0.3], [0.5, 0.05, 0.7]])
    assert found_heads(scores, 0.5) == [
        {"layer": 0, "head": 1, "score": scores[0, 1].item()},
        {"layer": 1, "head": 2, "score": scores[1, 2].item()},
        {"layer": 1, "head": 0, "score": 0.5},
    ]
    assert [(h["layer"], h["head"]) for h in top_heads(scores, 2)] == [(0, 1), (1, 2)]
    assert found_heads(scores, 0.95) == []


def test_table_escapes_text_and_aligns_numbers():
    page = table(["name", "value"], [["<b>&", 3], ["x", 0.123456]])
    assert "<td>&lt;b&gt;&amp;</td>" in page
    assert '<td class="num">3</td>' in page and '<td class="num">0.1235</td>' in page


def test_write_puts_every_figure_in_the_page_and_on_disk(tmp_path):
    section = Section("drift", "Drift <A>", {"x": 1}, "text", figures={"per layer/cos": PNG})
    written = Report([section], title="t").write(tmp_path / "new" / "dir")
    assert [p.name for p in written] == ["report.json", "report.html", "drift-per_layer_cos.png"]
    assert written[2].read_bytes() == PNG
    page = written[1].read_text()
    assert "<h2>Drift &lt;A&gt;</h2>" in page and "<pre>text</pre>" in page
    assert page.count("data:image/png;base64,") == 1
    assert '"figures": [\n    "drift-per_layer_cos.png"\n  ]' in written[0].read_text()


def test_layer_logit_kl_matches_torch_kl_div():
    generator = torch.Generator().manual_seed(0)
    p = torch.randn(3, 4, 10, generator=generator).softmax(-1)
    q = torch.randn(3, 4, 10, generator=generator).softmax(-1)
    expected = torch.nn.functional.kl_div(q.log(), p, reduction="none").sum(-1).mean(-1)
    torch.testing.assert_close(layer_logit_kl(p, q), expected)
    assert layer_logit_kl(p, p).abs().max() < 1e-6
