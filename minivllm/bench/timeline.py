"""A benchmark run over time, from the engine's step records (engine/step_history.py):
`--timeline FILE.png` (matplotlib) or `--timeline FILE.html` (self-contained: inline SVG, no
script, nothing fetched). Four panels share the time axis (seconds since the run's first step):

    requests   batch size (requests per step), running, waiting (queue length)
    tokens     prefill and decode tokens per step, the token budget
    budget     token budget use per step (%), KV cache use (%), cached prefix blocks (%)
    preempt    preemptions (cumulative since the run began)
"""

from __future__ import annotations

import html
import os

# (panel title, [(series label, field or derived name, colour)])
PANELS = [
    ("requests per step", [("batch size", "num_seqs", "#2c7bb6"), ("running", "num_running", "#1a9641"),
                           ("waiting (queue)", "num_waiting", "#f46d43")]),
    ("tokens per step", [("prefill", "prefill_tokens", "#fdae61"), ("decode", "decode_tokens", "#2c7bb6"),
                         ("budget", "token_budget", "#999999")]),
    ("use (%)", [("token budget", "budget_use", "#2c7bb6"), ("KV cache", "kv_use", "#d7191c"),
                 ("cached prefix blocks", "kv_cached", "#1a9641")]),
    ("preemptions", [("cumulative", "preemptions", "#d7191c")]),
]


def series(records: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """x (seconds from the first step) and every field the panels plot, derived ones included."""
    if not records:
        return [], {}
    t0, p0 = records[0]["t"], records[0]["preemptions_total"]
    xs = [r["t"] - t0 for r in records]
    cols: dict[str, list[float]] = {}
    for name in ("num_seqs", "num_running", "num_waiting", "prefill_tokens", "decode_tokens", "token_budget"):
        cols[name] = [r[name] for r in records]
    cols["budget_use"] = [100.0 * r["num_tokens"] / max(r["token_budget"], 1) for r in records]
    cols["kv_use"] = [100.0 * r["kv_used_blocks"] / max(r["num_blocks"], 1) for r in records]
    cols["kv_cached"] = [100.0 * r["kv_cached_blocks"] / max(r["num_blocks"], 1) for r in records]
    cols["preemptions"] = [r["preemptions_total"] - p0 for r in records]
    return xs, cols


def write_timeline(records: list, path: str, title: str = "minivllm run") -> str:
    """Writes the timeline of `records` (StepRecords or their dicts) to path (.png or .html)."""
    recs = [r if isinstance(r, dict) else r.to_dict() for r in records]
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".html"):
        raise ValueError(f"--timeline must name a .png or .html file, got {path!r}")
    if not recs:
        raise ValueError("the run recorded no engine steps: nothing to plot")
    xs, cols = series(recs)
    if ext == ".png":
        _write_png(xs, cols, path, title)
    else:
        with open(path, "w") as f:
            f.write(_html(xs, cols, title, len(recs)))
    return path


def _write_png(xs: list[float], cols: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(11, 2.3 * len(PANELS)), sharex=True)
    for ax, (panel, lines) in zip(axes, PANELS):
        for label, name, colour in lines:
            ax.plot(xs, cols[name], label=label, color=colour, linewidth=0.9,
                    linestyle="--" if name == "token_budget" else "-")
        ax.set_ylabel(panel)
        ax.legend(loc="upper right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_title(title)
    axes[-1].set_xlabel("seconds since the first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _svg_panel(xs: list[float], cols: dict[str, list[float]], panel: str, lines: list, w: int = 1000,
               h: int = 170) -> str:
    left, bottom = 50, 20
    x1 = max(xs[-1], 1e-9)
    y1 = max(max(cols[name]) for _, name, _ in lines) * 1.05 or 1.0
    parts = [f'<svg class="panel" width="{w}" height="{h}" viewBox="0 0 {w} {h}">',
             f'<rect x="{left}" y="2" width="{w - left - 2}" height="{h - bottom - 2}" fill="none" stroke="#ccc"/>',
             f'<text x="2" y="12" font-size="10">{y1:.3g}</text><text x="2" y="{h - bottom}" font-size="10">0</text>',
             f'<text x="{left}" y="{h - 4}" font-size="10">0 s</text>',
             f'<text x="{w - 60}" y="{h - 4}" font-size="10">{x1:.1f} s</text>']
    step = max(1, len(xs) // 2000)  # at most ~2,000 points a line
    for i, (label, name, colour) in enumerate(lines):
        pts = " ".join(f"{left + xs[j] / x1 * (w - left - 4):.1f},{h - bottom - cols[name][j] / y1 * (h - bottom - 6):.1f}"
                       for j in range(0, len(xs), step))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1" points="{pts}"/>')
        parts.append(f'<text x="{left + 8 + 150 * i}" y="14" font-size="11" fill="{colour}">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _html(xs: list[float], cols: dict[str, list[float]], title: str, num_steps: int) -> str:
    body = "".join(f"<h2>{html.escape(panel)}</h2>{_svg_panel(xs, cols, panel, lines)}" for panel, lines in PANELS)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            "<style>body{font:13px sans-serif;margin:12px}h2{font-size:13px;margin:8px 0 2px;color:#555}</style>"
            f'</head><body><h1 style="font-size:16px">{html.escape(title)}</h1>'
            f'<p id="summary">{num_steps} steps over {xs[-1]:.1f} s</p>{body}</body></html>')
