"""Per-step launch trace of `scripts/profile_w3_offline.py --trace-launch`: the steps whose launch
blocked (over step_stats.BLOCKED_LAUNCH_S) against the others, per launch part (ms) and
allocator counter (calls), then the first 40 steps one per line.

    python3 scripts/analyze_launch_trace.py TRACE.json [...]
"""

from __future__ import annotations

import json
import sys

from minivllm.bench.step_stats import BLOCKED_LAUNCH_S

KEYS = ("t_graph_try_run", "t_compute_logits", "t_build_step_inputs", "t_fill_placeholders",
        "t_forward_logits", "t_launch_sampling", "dev_alloc", "dev_free", "host_alloc", "host_free")


def _shown(key: str, value: float) -> float:
    return round(value * 1000, 1) if key.startswith("t_") else value


def _means(rows: list[dict]) -> dict:
    return {k: round(_shown(k, sum(r.get(k, 0) for r in rows) / len(rows)), 2) for k in KEYS}


def report(path: str) -> None:
    with open(path) as f:
        records = json.load(f)["records"]
    print(path, len(records), "steps")
    blocked = [r for r in records if r.get("launch", 0) > BLOCKED_LAUNCH_S]
    other = [r for r in records if r.get("launch", 0) <= BLOCKED_LAUNCH_S]
    for name, rows in (("blocked", blocked), ("other", other)):
        if rows:
            print(name, len(rows), _means(rows))
    for i, r in enumerate(records[:40]):
        print(i, r["tokens"], "launch", _shown("t_", r.get("launch", 0)), "wait", _shown("t_", r.get("wait", 0)),
              {k: _shown(k, r[k]) for k in KEYS if k in r})


if __name__ == "__main__":
    for p in sys.argv[1:]:
        report(p)
