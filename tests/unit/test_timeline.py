"""bench/timeline.py: the run's timeline as PNG (decodes, right size) and as self-contained HTML."""

from __future__ import annotations

import html.parser

import pytest

from minivllm.bench.timeline import PANELS, series, write_timeline


def _records(n: int = 50) -> list[dict]:
    out = []
    for i in range(n):
        prefill = 100 if i < 5 else 0
        out.append({"step": i, "t": 1000.0 + 0.1 * i, "num_seqs": min(i + 1, 8), "num_tokens": prefill + 8,
                    "prefill_tokens": prefill, "decode_tokens": 8, "token_budget": 256, "num_running": 8,
                    "num_waiting": max(0, 10 - i), "kv_used_blocks": i, "kv_cached_blocks": i // 2, "num_blocks": 100,
                    "preemptions_total": 3 + i // 10, "prefix_queries_total": 0, "prefix_hits_total": 0,
                    "spec_draft_tokens_total": 0, "spec_accepted_tokens_total": 0, "generation_tokens_total": 8 * i})
    return out


def test_series_derives_use_and_counts_preemptions_from_the_run_start():
    xs, cols = series(_records())
    assert xs[0] == 0.0 and xs[-1] == pytest.approx(4.9)
    assert cols["budget_use"][0] == pytest.approx(100 * 108 / 256) and cols["kv_use"][10] == pytest.approx(10.0)
    assert cols["preemptions"][0] == 0 and cols["preemptions"][-1] == 4
    assert all(name in cols for _, lines in PANELS for _, name, _ in lines)


def test_png_decodes(tmp_path):
    import matplotlib.image
    path = write_timeline(_records(), str(tmp_path / "run.png"), "test run")
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 600
    assert img[..., :3].std() > 0.05  # not a blank page


class _Collect(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.srcs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        self.srcs += [v for k, v in attrs if k in ("src", "href")]


def test_html_is_self_contained_svg(tmp_path):
    path = write_timeline(_records(), str(tmp_path / "run.html"), "test <run>")
    p = _Collect()
    p.feed(open(path).read())
    assert p.tags.count("svg") == len(PANELS) and p.tags.count("polyline") == sum(len(ls) for _, ls in PANELS)
    assert p.srcs == [] and "script" not in p.tags  # nothing fetched, nothing run
    assert "test &lt;run&gt;" in open(path).read()


def test_refuses_other_formats_and_empty_runs(tmp_path):
    with pytest.raises(ValueError, match=".png or .html"):
        write_timeline(_records(), str(tmp_path / "run.jpg"))
    with pytest.raises(ValueError, match="no engine steps"):
        write_timeline([], str(tmp_path / "run.png"))
