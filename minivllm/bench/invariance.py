"""Batch invariance under load (issue 22's benchmark): one prompt repeated N times among random
other requests, in batches of random size and order; counts the distinct outputs it got
(token ids and top logprobs, compared exactly). In batch-invariant mode that count must be 1.

    minivllm bench invariance [--repeats 1000] [--batch-invariant] [--model M] [--device cpu|cuda]
        [--max-tokens 16] [--output FILE]

Prints one JSON object: repeats, distinct outputs, seconds, and the engine settings.
"""

from __future__ import annotations

import argparse
import random
import time

TARGET = "Explain in two sentences why the sky looks blue during the day and red at sunset."
WORDS = "the of a river mountain light wave blue sun air scatter long short red evening morning".split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=1000, help="how many times the target prompt runs")
    p.add_argument("--batch-invariant", action="store_true", help="the mode under test (else default mode)")
    p.add_argument("--model", default=None, help="model path (default: the bundled model)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the JSON here")


def _batches(rng: random.Random, repeats: int) -> list[tuple[list, list[int]]]:
    """(prompts, indices of the target in them): 1-6 targets a batch among 0-40 random prompts."""
    out, left = [], repeats
    while left:
        k = min(left, rng.randint(1, 6))
        others = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 300))) for _ in range(rng.randint(0, 40))]
        prompts = others + [TARGET] * k
        rng.shuffle(prompts)
        out.append((prompts, [i for i, p in enumerate(prompts) if p is TARGET]))
        left -= k
    return out


def run(args) -> dict:
    from minivllm import LLM, SamplingParams
    kw = {"batch_invariant": True} if args.batch_invariant else {}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype, seed=args.seed,
              **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=3)
    rng = random.Random(args.seed)
    seen: dict[tuple, int] = {}
    t = time.perf_counter()
    for prompts, targets in _batches(rng, args.repeats):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i in targets:
            c = outs[i].outputs[0]
            key = (tuple(c.token_ids), tuple(tuple(sorted((t_, lp.logprob) for t_, lp in s.items())) for s in c.logprobs))
            seen[key] = seen.get(key, 0) + 1
    cfg = llm.llm_engine.config
    return {"repeats": args.repeats, "distinct_outputs": len(seen), "counts": sorted(seen.values(), reverse=True),
            "seconds": round(time.perf_counter() - t, 1), "batch_invariant": cfg.batch_invariant,
            "device": cfg.device, "dtype": cfg.model.dtype, "model": cfg.model.served_name}


def add_parser(sub) -> None:
    p = sub.add_parser("invariance", help="one prompt repeated under random load: distinct outputs (issue 22)")
    add_args(p)
    p.set_defaults(bench_func=cmd_invariance)


def cmd_invariance(args) -> int:
    out = run(args)
    from minivllm.bench.common import emit
    emit(out, args.output)
    return 0 if not args.batch_invariant or out["distinct_outputs"] == 1 else 1
