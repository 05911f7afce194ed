"""Issue 25's next question, on the GPU: do a decode token's 128 W4A16 GEMVs (Llama-3.1-8B, 32 layers
x qkv, o, gate_up, down, AWQ group 128, float16) lose their ~4-5 us each above their bytes when
they run as ONE persistent launch with grid barriers (kernels/gemv_chain.py) instead of 128
launches in a CUDA graph with PDL (what the engine's decode graph runs)?

Timed, each as a CUDA graph of one token's GEMVs (the model's 3.7 GB of weights, so nothing stays in
L2), median of RUNS replays, ms a token:
  separate-same   the 128 launches with the chain's tile (BLOCK_N 32, BLOCK_K 256, 4 K slices)
  separate-kept   the 128 launches as the engine runs them (the kept GEMV table's launch per weight)
  chain-P-fF      the persistent chain with P programs, L2 prefetch of F K steps before each wait
and the GEMV bytes at the card's copy rate (the floor). The chain's outputs should equal
separate-same's bit for bit (checked on every stage and reported; a chain further than 1 % from
them is not timed).

    timeout 300 python3 scripts/bench_gemv_chain.py [--out chain.json] [--programs 132,264,resident]

A hang would mean a grid larger than what is resident at once: GemvChain refuses those, and
the gpu_multi step runs this under `timeout`.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

LAYERS = 32
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down
GROUP = 128
RUNS = 20


def graph_ms(fn, runs: int = RUNS) -> float:
    """Median ms of one replay of a CUDA graph of fn() (run eagerly twice first)."""
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def separate(stages, config: dict | None, split: int | None) -> list[torch.Tensor]:
    """The stages as one w4a16_gemm launch each, each reading the previous launch's output: the outputs."""
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    x, outs = stages[0][3], []
    for qw, sc, z, _, _ in stages:
        k = qw.shape[0] * 8
        x = w4a16_gemm(x[:k].view(1, k), qw, sc, z, GROUP, split, dict(config) if config else None).view(-1)
        outs.append(x)
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--programs", default="132,264,resident")
    p.add_argument("--prefetch", default="0,1,2")
    args = p.parse_args()
    from minivllm.bench.common import measure_copy_bandwidth
    from minivllm.kernels.gemv_chain import GemvChain, chain_meta, random_stages

    stages = random_stages(SHAPES * LAYERS, GROUP, "cuda")  # a layer's four GEMVs x 32, one token's
    gemv_bytes = sum(qw.numel() * 4 + sc.numel() * 2 + z.numel() * 2 for qw, sc, z, _, _ in stages)
    bandwidth = measure_copy_bandwidth()["bandwidth_Bps"]
    report = {"device": torch.cuda.get_device_name(0), "gemv_bytes": gemv_bytes, "copy_TBps": bandwidth / 1e12,
              "floor_ms": 1e3 * gemv_bytes / bandwidth, "ms": {}}
    print(f"{len(stages)} GEMVs, {gemv_bytes / 1e9:.2f} GB: {report['floor_ms']:.3f} ms at {bandwidth / 1e12:.2f} TB/s",
          flush=True)
    same_cfg = {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "PIPE": True}
    sep_outs = separate(stages, same_cfg, 4)  # (eager: the bits the chain must give)
    report["ms"]["separate-same"] = graph_ms(lambda: separate(stages, same_cfg, 4))
    report["ms"]["separate-kept"] = graph_ms(lambda: separate(stages, None, None))
    for name in ("separate-same", "separate-kept"):
        print(f"{name}: {report['ms'][name]:.3f} ms a token", flush=True)
    meta = chain_meta(stages)
    limit = GemvChain(meta, max(n for n, _ in SHAPES), 1, even=True).resident_limit()  # (each chain checks its own)
    report["resident_limit"] = limit
    print(f"resident programs at most: {limit}", flush=True)
    for programs in args.programs.split(","):
        grid = limit if programs == "resident" else int(programs)
        if grid > limit:
            print(f"chain-{grid}: skipped (over the resident limit {limit})")
            continue
        for prefetch in (int(f) for f in args.prefetch.split(",")):
            name = f"chain-{grid}-f{prefetch}"
            chain = GemvChain(meta, max(n for n, _ in SHAPES), grid, prefetch_steps=prefetch, even=True)
            chain()
            torch.cuda.synchronize()
            if chain.timed_out():
                print(f"{name}: a barrier gave up waiting (programs not all resident?): not timed", flush=True)
                report.setdefault("timed_out", []).append(name)
                continue
            pairs = [(a, out) for a, (*_, out) in zip(sep_outs, stages)]
            same = all(torch.equal(a.view(torch.int16), out.view(torch.int16)) for a, out in pairs)
            diff = max(((a.float() - out.float()).norm() / a.float().norm()).item() for a, out in pairs)
            report.setdefault("same_bits", {})[name] = same
            report.setdefault("max_rel_diff", {})[name] = diff
            if not same:  # (timed anyway when close: a reduction order can differ between two kernels)
                print(f"{name}: outputs differ from separate-same (largest relative difference {diff:.3g})", flush=True)
                if not diff < 1e-2:
                    continue
            report["ms"][name] = graph_ms(chain)
            print(f"{name}: {report['ms'][name]:.3f} ms a token ({report['floor_ms'] / report['ms'][name]:.0%} of "
                  f"the copy rate)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
