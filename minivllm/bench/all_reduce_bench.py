"""The tensor-parallel all-reduce on this machine's GPUs: correctness of the symmetric-memory
kernels (distributed/symm_all_reduce.py) against NCCL, and the time of each at decode sizes.

    python -m minivllm.bench.all_reduce_bench --world-size 2 [--output FILE] [--check-only]

One process per GPU (spawned). Checks, on every rank:
  - one-shot and two-shot, bf16 and fp32, sizes from 16 bytes to the buffer's size, each equal
    bit for bit to the same additions done in rank order on the gathered inputs, and the same
    bits on every rank (what TensorParallelGroup.all_reduce promises);
  - the same inside a CUDA graph, replayed on new data;
  - TensorParallelGroup.all_reduce routes decode sizes to the kernels and larger ones to NCCL.
Timing (unless --check-only): each method in a CUDA graph of 32 back-to-back calls, replayed,
microseconds a call (rank 0's events), for messages of 8 KB to 8 MB (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
CHECK_NUMELS = [4, 8, 1000, 4096, 65536, 1 << 20]  # up to 2 MiB (bf16) / 4 MiB (fp32)
CALLS_PER_GRAPH = 32


def _setup(rank: int, world: int, init_file: str):
    import torch.distributed as dist
    from minivllm.distributed.communication import TensorParallelGroup
    from minivllm.distributed import symm_all_reduce
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast stays off on shared hosts
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=device)
    group = dist.new_group(list(range(world)))
    tp = TensorParallelGroup(group, rank, world, device)
    tp.all_reduce(torch.zeros(1, device=device))
    tp.custom = symm_all_reduce.build(group, world, device, disabled=False)
    return dist, group, tp, device


def _rank_order_sum(dist, group, x: torch.Tensor, world: int) -> torch.Tensor:
    """The inputs of every rank added in rank order in x's dtype (the kernels' order)."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


def _same_on_every_rank(dist, group, x: torch.Tensor, world: int) -> bool:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def check(rank: int, world: int, dist, group, tp, device) -> list[str]:
    """What failed (empty: everything held)."""
    comm = tp.custom
    if comm is None:
        return ["the symmetric-memory all-reduce could not be built (see the log)"]
    failures = []
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for numel in CHECK_NUMELS:
            if numel * torch.finfo(dtype).bits // 8 > comm.max_bytes:
                continue
            x = torch.randn(numel, generator=gen, device=device, dtype=torch.float32).to(dtype)
            want = _rank_order_sum(dist, group, x, world)
            for one_shot in (True, False):
                got = comm._reduce(x.clone(), one_shot)
                name = f"{'one' if one_shot else 'two'}-shot {dtype} numel={numel}"
                if not torch.equal(got, want):
                    failures.append(f"{name}: max abs diff {(got.float() - want.float()).abs().max().item()}")
                if not _same_on_every_rank(dist, group, got, world):
                    failures.append(f"{name}: ranks differ")
    # inside a CUDA graph: capture on a static buffer, replay on new data
    static = torch.zeros(256, 4096, device=device, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tp.all_reduce(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        tp.all_reduce(static)
    for _ in range(3):
        x = torch.randn(static.shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        want = _rank_order_sum(dist, group, x, world)
        static.copy_(x)
        graph.replay()
        if not torch.equal(static, want):
            failures.append("CUDA graph replay: differs from the rank-order sum")
            break
    # routing: a decode-sized message takes the kernels, a prefill-sized one NCCL
    comm.calls = {"one_shot": 0, "two_shot": 0}
    tp.all_reduce(torch.ones(64, 4096, device=device, dtype=torch.bfloat16))
    big = torch.ones(comm.max_bytes // 2 + 4096, device=device, dtype=torch.bfloat16)
    tp.all_reduce(big)
    if sum(comm.calls.values()) != 1:
        failures.append(f"routing: {comm.calls} kernel calls for one decode-sized and one too-large message")
    if not torch.equal(big, torch.full_like(big, world)):
        failures.append("the NCCL fallback summed wrong")
    return failures


def time_methods(rank: int, world: int, dist, group, tp, device) -> dict:
    comm = tp.custom
    methods = {"nccl": lambda x: dist.all_reduce(x, group=group)}
    if comm is not None:
        methods["one_shot"] = lambda x: comm._reduce(x, True)
        methods["two_shot"] = lambda x: comm._reduce(x, False)
    table: dict[str, dict[str, float]] = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
        row = {}
        for name, fn in methods.items():
            if name != "nccl" and nbytes > comm.max_bytes:
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(CALLS_PER_GRAPH):
                    fn(x)
            graph.replay()
            torch.cuda.synchronize()
            dist.barrier(group=group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            row[name] = round(start.elapsed_time(end) * 1000 / (10 * CALLS_PER_GRAPH), 2)
        table[f"{nbytes // 1024} KiB"] = row
    return table


def _rank_main(rank: int, world: int, init_file: str, out_file: str, check_only: bool) -> None:
    dist, group, tp, device = _setup(rank, world, init_file)
    result = {"world_size": world, "device": torch.cuda.get_device_name(device),
              "custom_built": tp.custom is not None}
    result["failures"] = check(rank, world, dist, group, tp, device)
    if not check_only:
        result["us_per_call"] = time_methods(rank, world, dist, group, tp, device)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)
    elif result["failures"]:
        with open(f"{out_file}.rank{rank}", "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier(group=group)
    dist.destroy_process_group()


def run(world: int, check_only: bool = False) -> dict:
    """Spawn `world` ranks; rank 0's result (with every rank's failures folded in)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.spawn(_rank_main, args=(world, init_file, out_file, check_only), nprocs=world, join=True)
        with open(out_file) as f:
            result = json.load(f)
        for r in range(1, world):
            path = f"{out_file}.rank{r}"
            if os.path.exists(path):
                with open(path) as f:
                    result["failures"] += [f"rank {r}: {m}" for m in json.load(f)["failures"]]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--output", default=None)
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args(argv)
    result = run(args.world_size, args.check_only)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
