"""Where a rank's GPU time goes, from a torch-profiler Chrome trace (bench --profile's files,
.json or .json.gz): busy time (the union of kernel intervals), idle gaps between kernels by
size, and the kernels grouped by kind (communication, GEMM, attention, the rest).

    python scripts/trace_gaps.py TRACE [TRACE ...] [--json OUT]

Used for issue 27's tensor-parallel scaling: one rank's trace at tp=2 next to the one rank of
tp=1 shows whether the step is longer because of kernels (and which) or because the GPU waits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict

from minivllm.bench.common import emit

KINDS = [  # first match wins
    ("all-reduce (symm-mem)", re.compile(r"all_reduce|allreduce_kernel|one_shot|two_shot", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("gemm", re.compile(r"gemm|gemv|sm90_xmma|cutlass|matmul|nvjet|w4a16|_mm_", re.I)),
    ("attention", re.compile(r"attention|attn|flash|decode_|prefill_", re.I)),
    ("sampling", re.compile(r"argmax|topk|top_k|sort|softmax|exponential|sampl|multinomial", re.I)),
    ("norm/rotary/act", re.compile(r"norm|rotary|rope|silu|swiglu|act_and_mul", re.I)),
    ("copy/fill", re.compile(r"copy|memcpy|memset|fill|cat|index", re.I)),
]
GAP_BINS_US = [2, 5, 10, 50, 200, 1000, 10_000]


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def analyse(events: list[dict]) -> dict:
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                     key=lambda e: e["ts"])
    if not kernels:
        return {"kernels": 0}
    by_kind: dict[str, float] = defaultdict(float)
    top: dict[str, list] = defaultdict(lambda: [0, 0.0])
    busy, gaps = 0.0, []
    cur_start, cur_end = kernels[0]["ts"], kernels[0]["ts"]
    for e in kernels:
        start, end = e["ts"], e["ts"] + e["dur"]
        by_kind[kind_of(e["name"])] += e["dur"]
        t = top[e["name"][:90]]
        t[0] += 1
        t[1] += e["dur"]
        if start > cur_end:  # a gap on this GPU (streams merged)
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start = start
        cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - kernels[0]["ts"]
    hist = {}
    lo = 0
    for hi in GAP_BINS_US + [float("inf")]:
        sel = [g for g in gaps if lo <= g < hi]
        hist[f"{lo}-{hi} us"] = {"count": len(sel), "total_ms": round(sum(sel) / 1e3, 3)}
        lo = hi
    return {
        "kernels": len(kernels),
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "kernel_ms_by_kind": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "idle_gaps": hist,
        "top_kernels": [{"name": n, "count": c, "ms": round(d / 1e3, 3)}
                        for n, (c, d) in sorted(top.items(), key=lambda kv: -kv[1][1])[:15]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    emit({path: analyse(load(path)) for path in args.traces}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
