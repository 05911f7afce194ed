"""Development probe: where W1's time goes. Runs W1 (dummy Qwen3-0.6B), timing each engine step
phase on the host, and profiles a window of full-batch decode steps with torch.profiler."""

import json
import time
from random import randint, seed

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.model_dirs import write_model_dir

def main():
    d = write_model_dir("qwen3-0.6b")
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    eng = llm.llm_engine
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)) for _ in range(256)]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    phases = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    steps, t0, prof_done = 0, time.perf_counter(), False
    sched, runner = eng.scheduler, eng.executor.runner
    orig_schedule, orig_execute, orig_update = sched.schedule, eng.executor.execute, sched.update

    def timed(name, fn):
        def wrap(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            phases[name] += time.perf_counter() - t
            return r
        return wrap
    sched.schedule, eng.executor.execute, sched.update = (timed("schedule", orig_schedule),
                                                         timed("execute", orig_execute), timed("update", orig_update))
    while eng.has_unfinished_requests():
        if steps == 300 and not prof_done:
            prof_done = True
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                tp = time.perf_counter()
                for _ in range(20):
                    eng.step()
                torch.cuda.synchronize()
                tp = time.perf_counter() - tp
            print(f"profiled 20 steps ({sched.num_running} running): {tp * 1000 / 20:.2f} ms/step wall")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
            steps += 20
            continue
        eng.step()
        steps += 1
    wall = time.perf_counter() - t0
    print(json.dumps({"steps": steps, "wall_s": round(wall, 2), "ms_per_step": round(wall * 1000 / steps, 2),
                      "phases_s": {k: round(v, 2) for k, v in phases.items()}}))


if __name__ == "__main__":
    main()
