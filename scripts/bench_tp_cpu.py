"""Issue 20's CPU figure: per-step time of the bundled model with tensor_parallel_size N
(docs/perf.md). Usage: python scripts/bench_tp_cpu.py N  (1: in process; N > 1: N mp workers)."""

from __future__ import annotations

import sys
import time

from minivllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
STEPS = 64


def main(tp: int) -> None:
    llm = LLM(dtype="float32", device="cpu", tensor_parallel_size=tp, max_model_len=512)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for batch in (1, 4):
        t = time.perf_counter()
        llm.generate(PROMPTS[:batch], params, use_tqdm=False)
        ms = (time.perf_counter() - t) / STEPS * 1000
        print(f"tp={tp} batch={batch}: {ms:.1f} ms per step ({STEPS} decode steps, prompt included)", flush=True)
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
