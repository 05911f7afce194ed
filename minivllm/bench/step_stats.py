"""Summaries of per-step engine records (`LLMEngine.last_step` plus the step's wall time), as
written by the engine core's MINIVLLM_STEP_LOG.

    python -m minivllm.bench.step_stats steps.jsonl

Steps split into pure-decode steps (one token per scheduled sequence) and steps that carry
prefill tokens; decode steps also by running-batch band, to show how host time grows with it.
"""

from __future__ import annotations

import json
import statistics
import sys

PHASES = ("schedule", "launch", "wait", "update", "outputs")
# a launch longer than this blocked the host on the device (e.g. a lazy kernel load, perf.md
# session 5); with async scheduling it also holds back the previous step's tokens
BLOCKED_LAUNCH_S = 0.05


def is_decode_step(record: dict) -> bool:
    """One token per scheduled sequence: no prompt tokens in the step."""
    return record.get("tokens") == record.get("seqs")


def _mean_ms(rows: list[dict], key: str) -> float:
    return round(statistics.fmean(r.get(key, 0.0) for r in rows) * 1e3, 2)


def summarize(records: list[dict], band: int = 200) -> dict:
    out: dict = {}
    decode = [r for r in records if is_decode_step(r)]
    mixed = [r for r in records if not is_decode_step(r)]
    for kind, rows in (("decode", decode), ("mixed", mixed)):
        if not rows:
            continue
        g = {"steps": len(rows), "wall_s_sum": round(sum(r["wall"] for r in rows), 2), "wall_ms": _mean_ms(rows, "wall")}
        g.update({p + "_ms": _mean_ms(rows, p) for p in (*PHASES, "pack") if any(p in r for r in rows)})
        walls = sorted(r["wall"] for r in rows)
        g["wall_ms_p99"] = round(walls[min(len(walls) - 1, int(0.99 * len(walls)))] * 1e3, 2)
        g["wall_ms_max"] = round(walls[-1] * 1e3, 2)
        g["launch_over_50ms"] = sum(r.get("launch", 0.0) > BLOCKED_LAUNCH_S for r in rows)
        g["running_mean"] = round(statistics.fmean(r.get("running", 0) for r in rows), 1)
        g["tokens_mean"] = round(statistics.fmean(r.get("tokens", 0) for r in rows), 1)
        out[kind] = g
    bands: dict[int, list[dict]] = {}
    for r in decode:
        bands.setdefault(r.get("running", 0) // band * band, []).append(r)
    out["decode_by_running"] = {
        str(b): {"steps": len(v), "wall_ms": _mean_ms(v, "wall"),
                 "host_ms": round(statistics.fmean(sum(x.get(p, 0.0) for p in PHASES if p != "wait") for x in v) * 1e3, 2),
                 "wait_ms": _mean_ms(v, "wait")}
        for b, v in sorted(bands.items())}
    return out


def main(argv: list[str] | None = None) -> int:
    path = (argv or sys.argv[1:])[0]
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(summarize(records), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
