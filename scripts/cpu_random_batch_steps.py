"""CPU probe: median decode-step time of 32 requests sampling at temperature 1.0 (120-token
prompts, 40 output tokens), 3 rounds after a warm-up round.

    python scripts/cpu_random_batch_steps.py
"""
import time, statistics
from minivllm import LLM, SamplingParams
llm = LLM(dtype="float32", device="cpu", seed=0)
eng = llm.llm_engine
def run():
    for i in range(32):
        eng.add_request(f"r{time.time()}{i}", list(range(100 + i, 220 + i)), SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    dec = []
    while eng.has_unfinished_requests():
        t = time.perf_counter(); eng.step(); dt = time.perf_counter() - t
        if eng.last_step["tokens"] == eng.last_step["seqs"]: dec.append(dt)
    return statistics.median(dec) * 1000
run()
print("decode step median ms:", [round(run(), 1) for _ in range(3)])
