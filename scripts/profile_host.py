"""Host (CPU) cost of one engine step per running request, without a GPU: the tiny dummy
Llama on the CPU, N requests decoding together; cProfile of the decode steps.

    python scripts/profile_host.py --num-requests 1000 --steps 20 [--top 30]

The model is tiny, so what the profile shows is the engine's own work: scheduling, input
batch building, sampling bookkeeping, output processing (no detokenization: no tokenizer).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from minivllm.bench.model_dirs import write_model_dir
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import RequestOutputKind, SamplingParams

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    d = write_model_dir("tiny-llama")
    n = args.num_requests
    eng = LLMEngine.from_kwargs(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu",
                                dtype="float32", max_num_seqs=n, max_num_batched_tokens=max(8192, n),
                                num_kv_blocks=n * 8 + 16, max_model_len=1024)
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(n):
        eng.add_request(str(i), [rng.randrange(1000) for _ in range(rng.randrange(20, 60))], params)
    while eng.scheduler.num_waiting:  # prefill everything first
        eng.step()
    for _ in range(3):
        eng.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    dt = (time.perf_counter() - t0) / args.steps
    print(f"{n} running requests: {dt * 1e3:.1f} ms per step = {dt / n * 1e6:.1f} us per request (with cProfile on)")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    dt = (time.perf_counter() - t0) / args.steps
    print(f"without profiler: {dt * 1e3:.1f} ms per step = {dt / n * 1e6:.1f} us per request")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
