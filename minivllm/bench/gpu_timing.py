"""Timing one kernel call as a decode step's CUDA graph sees it, with its weights streamed from
HBM (the micro-benchmarks of scripts/: bench_w4a16_gemv.py, bench_dense_gemv.py)."""

from __future__ import annotations

import math
import statistics

import torch

L2_BYTES = 50 << 20  # an H100's L2


def copies_for(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """Weight copies to cycle through so that together they exceed 4x the L2 (at most 64): each
    call then reads its weight from HBM, as the layers of a real step do."""
    return max(1, min(64, math.ceil(4 * l2_bytes / nbytes)))


def time_graph(fn, copies: int, runs: int = 30, calls: int = 32) -> float:
    """Median us per call over `runs` replays of one CUDA graph of `calls` calls of fn(i), i
    cycling over the weight copies (a few eager calls first: compiles and allocations stay
    out of the capture)."""
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    for _ in range(3):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for i in range(runs):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / calls
