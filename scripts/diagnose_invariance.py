"""Where does a prompt computed in chunks stop matching the same prompt in one step?

Batch-invariant mode (issue 22) must give the same bits for a prompt computed in one step and in
64-token chunks. This diagnostic runs the default model on the GPU (bf16, eager: hooks do not
run inside CUDA graphs) in the invariant mode twice, with max_tokens=1: once with the whole
prompt in one step, once with max_num_batched_tokens=64, and records every module's output rows
for the prompt's tokens (forward hooks; rows concatenated across the chunks). It prints, in
execution order, the first modules whose rows differ and by how much.

    python3 scripts/diagnose_invariance.py [--chunk 64] [--no-invariant]
"""

from __future__ import annotations

import argparse
import gc
from collections import defaultdict

import torch

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The message is "
          "from someone who lived in the same lighthouse a hundred years ago, and it says") * 4


def capture(chunk: int | None, invariant: bool, device: str, dtype: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    from minivllm import LLM, SamplingParams
    kw = dict(device=device, dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=1 << 30, seed=0,
              enforce_eager=True, batch_invariant=invariant, enable_prefix_caching=False)
    if chunk:
        kw["max_num_batched_tokens"] = chunk
    llm = LLM(**kw)
    model = llm.llm_engine.executor.runner.model
    rows: dict[str, list[torch.Tensor]] = defaultdict(list)
    order: list[str] = []

    def hook(name):
        def fn(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.dim() >= 2:
                if name not in rows:
                    order.append(name)
                rows[name].append(out.detach().reshape(out.shape[0], -1).float().cpu())
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for h in handles:
        h.remove()
    llm.llm_engine.shutdown()
    del llm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {k: torch.cat(v) for k, v in rows.items()}, order


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--no-invariant", action="store_true")
    p.add_argument("--show", type=int, default=12)
    p.add_argument("--device", default="cuda", help="cpu (float32) checks the plumbing")
    args = p.parse_args()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    whole, order = capture(None, not args.no_invariant, args.device, dtype)
    chunked, _ = capture(args.chunk, not args.no_invariant, args.device, dtype)
    shown = 0
    for name in order:
        a, b = whole.get(name), chunked.get(name)
        if a is None or b is None:
            print(f"{name}: missing in one run")
            continue
        n = min(a.shape[0], b.shape[0])
        if a.shape[0] != b.shape[0] or a.shape[1] != b.shape[1]:
            print(f"{name}: rows {a.shape} vs {b.shape} (comparing the first {n})")
        diff = (a[:n] - b[:n]).abs()
        bad_rows = (diff.amax(dim=1) > 0).nonzero().flatten().tolist()
        if bad_rows:
            print(f"DIFF {name}: {len(bad_rows)}/{n} rows differ, first rows {bad_rows[:8]}, "
                  f"max abs {diff.max().item():.3g}")
            shown += 1
            if shown >= args.show:
                break
    if shown == 0:
        print(f"every module's rows are bitwise equal ({len(order)} modules)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
