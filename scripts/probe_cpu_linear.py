"""minivllm's packed-panel linear kernel against oneDNN's packed linear on this CPU, at the
linear shapes of SmolLM2-135M (the four decoder linears x 30 layers + the lm_head), cache-warm
(each weight timed alone) and as the model's chain over cold weights (30 distinct layers).

    python scripts/probe_cpu_linear.py [--variant avx2|avx512] [--threads N] [--rows 1 32 2048]

Decides `KERNEL_PREFERRED_VENDORS` in models/cpu_linear.py (docs/perf.md, session 7)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minivllm.kernels import cpu_kernels

SHAPES = [(576, 1344), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
LM_HEAD = (576, 49152)


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _onednn(x, p):
    return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 2048])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_kernels.load(args.variant)
    print(f"variant {ops.vector_isa()}, panel {ops.packed_panel_width()}, threads {torch.get_num_threads()}")
    torch.manual_seed(0)
    flops_per_row = 2 * (30 * sum(k * n for k, n in SHAPES) + LM_HEAD[0] * LM_HEAD[1])
    for m in args.rows:
        warm = {"onednn": 0.0, "ours": 0.0}
        for (k, n), count in [(s, 30) for s in SHAPES] + [(LM_HEAD, 1)]:
            w, x = torch.randn(n, k), torch.randn(m, k)
            assert torch.allclose(ops.packed_linear(x, ops.pack_linear_weight(w), n, None), F.linear(x, w),
                                  rtol=1e-4, atol=1e-3)
            reps = 20 if m < 256 else 3
            p, q = torch.ops.mkldnn._reorder_linear_weight(w, None), ops.pack_linear_weight(w)
            warm["onednn"] += count * _median_s(lambda: _onednn(x, p), reps)
            warm["ours"] += count * _median_s(lambda: ops.packed_linear(x, q, n, None), reps)
        print(f"rows {m}, warm: " + ", ".join(f"{name} {1e3 * s:.1f} ms ({flops_per_row * m / s / 1e9:.0f} GFLOP/s)"
                                              for name, s in warm.items()))
    # the model's chain over cold weights
    chain = [(k, n, torch.randn(n, k)) for _ in range(30) for k, n in SHAPES] + [(*LM_HEAD, torch.randn(LM_HEAD[1], LM_HEAD[0]))]
    packed = {"onednn": [(k, torch.ops.mkldnn._reorder_linear_weight(w, None)) for k, n, w in chain],
              "ours": [(k, n, ops.pack_linear_weight(w)) for k, n, w in chain]}
    for m in [r for r in args.rows if r <= 64]:
        xs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
        t_dnn = _median_s(lambda: [_onednn(xs[k], p) for k, p in packed["onednn"]], 7)
        t_ours = _median_s(lambda: [ops.packed_linear(xs[k], p, n, None) for k, n, p in packed["ours"]], 7)
        print(f"rows {m}, chain over cold weights: onednn {1e3 * t_dnn:.1f} ms, ours {1e3 * t_ours:.1f} ms "
              f"({t_dnn / t_ours:.2f}x)")


if __name__ == "__main__":
    main()
