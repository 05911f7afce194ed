"""Quick W1 (BENCHMARKS.md) on minivllm with dummy Qwen3-0.6B weights: a development probe, not
the benchmark of record (that is `minivllm bench throughput`)."""

import json
import sys
import time
from random import randint, seed

t_start = time.perf_counter()
from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.bench.model_dirs import write_model_dir  # noqa: E402

def main():
    d = write_model_dir("qwen3-0.6b")
    eager = "--eager" in sys.argv
    t = time.perf_counter()
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, enforce_eager=eager)
    startup = time.perf_counter() - t
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)) for _ in range(256)]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    runner = llm.llm_engine.executor.runner
    print(json.dumps({"eager": eager, "startup_s": round(startup, 1), "output_tokens": n, "seconds": round(dt, 2),
                      "tok_per_s": round(n / dt, 1), "timings": runner.timings,
                      "memory": getattr(runner, "memory_report", None)}))


if __name__ == "__main__":
    main()
