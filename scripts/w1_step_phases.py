"""W1-8B's engine steps, host phase by phase, by running batch: where a step's time goes in a
whole W1 run (issue 27: tp=2 against tp=1 and vLLM), not only at batch 256.

    python scripts/w1_step_phases.py --out DIR [--tp 2] [--backend mp] [--label NAME]

One warm-up generate, then one timed generate of W1-8B's 256 requests (dummy weights), every
engine step recorded (`MinivllmAdapter.record_steps`: schedule, launch, wait = blocked on the
device, update, outputs, and the step's wall time). Writes DIR/<label>-steps.jsonl (one record a
step, with the running batch and tokens) and prints minivllm.bench.step_stats' summary: decode
steps by running band, their wall, host and wait milliseconds. A decode step whose core waited
~0 ms was bound by the host (the core, or with the mp executor the ranks' work behind it);
"decode_stalls" counts decode steps over 30 ms after two decode steps (a rank's full GC pass
was one cause).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import minivllm
from minivllm.bench import model_dirs, workloads
from minivllm.bench.run_minivllm import MinivllmAdapter
from minivllm.bench.step_stats import summarize

STALL_S = 0.03  # a decode step this long stalled (W1-8B's decode steps take 6-16 ms on an H200)


def stalled_decode_steps(steps: list[dict]) -> list[dict]:
    """Decode steps over STALL_S whose two steps before were decode steps too: with steps in
    flight, the first decode steps after the prefill wait for the prefill steps still running,
    and the last (empty) step drains what is in flight; neither is a stall."""
    def decode(s):
        return 0 < s.get("tokens", 0) == s.get("seqs")
    return [s for i, s in enumerate(steps)
            if i >= 2 and decode(s) and decode(steps[i - 1]) and decode(steps[i - 2]) and s["wall"] > STALL_S]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--backend", default=None, help="distributed_executor_backend (default: the engine's)")
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    wl = workloads.get("W1-8B")
    kw = {"tensor_parallel_size": args.tp, "max_model_len": wl.max_model_len}
    if args.backend:
        kw["distributed_executor_backend"] = args.backend
    adapter = MinivllmAdapter(model_dirs.write_model_dir(wl.model_config), **kw)
    prepared = adapter.prepare(wl.params)
    adapter.generate(wl.prompt_inputs()[:8], prepared[:8])  # warm-up
    with adapter.record_steps() as steps:
        t = time.perf_counter()
        outs = adapter.generate(wl.prompt_inputs(), prepared)
        wall = time.perf_counter() - t
    label = args.label or f"tp{args.tp}-{args.backend or 'default'}-ahead{os.environ.get('MINIVLLM_STEPS_AHEAD', 'default')}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{label}-steps.jsonl"), "w") as f:
        for s in steps:
            f.write(json.dumps(s) + "\n")
    tokens = sum(o.num_tokens for o in outs)
    stalls = [s["wall"] for s in stalled_decode_steps(steps)]
    summary = {"label": label, "package": os.path.dirname(minivllm.__file__), "output_tok_per_s": round(tokens / wall, 1),
               "wall_s": round(wall, 3), "steps": len(steps), "decode_stalls": len(stalls),
               "decode_stalls_s": round(sum(stalls), 3), **summarize(steps, band=32)}
    print(json.dumps(summary))
    adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
