"""The configuration grid: a request's tokens must not depend on how the engine cuts work into steps.

The engine runs the same requests under many configurations that change the steps (token budget
from 1 token up, sequences per step, block size, chunked prefill, prefix caching with shared
prefixes, a KV cache small enough to preempt constantly, the CPU's kernel paths or, on a GPU, CUDA
graphs, eager mode and async scheduling) and compares every request's tokens with what the same
model path gives under the unconstrained configuration (every prompt in one step, no cache
pressure). Greedy requests must match token for token, and so must seeded sampled ones (the
sampler's noise for a seeded request does not depend on the batch); every request must end with
`stop` or `length`, never `error`.

The prompts are cut from real text at the lengths where steps change shape: 1 and 2 tokens, one
around each block size and budget boundary (b - 1, b, b + 1), half and all of the context
(max_model_len - 1), plus a family sharing a long prefix and an exact duplicate (prefix hits).

    minivllm bench config-grid                  # the full grid on the CPU, every model path
    minivllm bench config-grid --device cuda    # the GPU paths (graphs, eager, sync)
    minivllm bench config-grid --quick          # the slice CI runs (tests/integration)

The model is loaded once per path (environment switches that select the CPU kernels) and shared
by every engine of that path (LLMEngine(config, model=...)).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from minivllm.sampling_params import SamplingParams

# Environment switches that pick a CPU model path at load time (models/cpu_linear.py,
# models/cpu_forward.py, kernels/cpu_kernels.py).
CPU_PATHS = {
    "kernels": {},  # the compiled C++ kernels: fused forward, panel linears (AMD), decode kernel
    "torch": {"MINIVLLM_CPU_KERNELS": "0"},  # the fewer-ops forward on PyTorch ops, oneDNN linears
    "module": {"MINIVLLM_CPU_KERNELS": "0", "MINIVLLM_CPU_FAST_FORWARD": "0", "MINIVLLM_CPU_PACKED_LINEAR": "0"},
}
GPU_PATHS = {
    "graphs": {"enforce_eager": False, "async_scheduling": True},
    "eager": {"enforce_eager": True, "async_scheduling": True},
    "sync": {"enforce_eager": False, "async_scheduling": False},
}
MAX_NEW_TOKENS = 6
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Books became cheaper, "
    "literacy spread across Europe, and scholars could compare identical copies of a text for the first time. "
    "Within fifty years presses were running in more than two hundred cities. Newspapers, pamphlets and maps "
    "followed, and with them new trades: typefounders, paper merchants, booksellers and censors. Historians "
    "still argue about how quickly ordinary people felt the change, but few doubt that the scientific "
    "revolution, the Reformation and the modern idea of an author all owe something to the humble press. "
)


@dataclass(frozen=True)
class GridPoint:
    """One engine configuration. Defaults are the unconstrained reference."""

    path: str = "kernels"  # a key of CPU_PATHS or GPU_PATHS
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    tiny_kv: bool = False  # a KV cache just large enough for the longest request: preempts constantly

    @property
    def label(self) -> str:
        return (f"{self.path} budget={self.max_num_batched_tokens} seqs={self.max_num_seqs} bs={self.block_size}"
                f"{'' if self.enable_chunked_prefill else ' no-chunk'}{' prefix' if self.enable_prefix_caching else ''}"
                f"{' tiny-kv' if self.tiny_kv else ''}")


@dataclass(frozen=True)
class GridRequest:
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class PointResult:
    point: GridPoint
    mismatches: list[str]  # one line per request whose tokens differ from the reference
    bad_finishes: list[str]  # requests that ended other than stop/length
    num_preemptions: int
    prefix_hit_tokens: int
    leaked_blocks: int  # blocks not free after every request ended
    seconds: float

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.bad_finishes or self.leaked_blocks)


# ---- prompts --------------------------------------------------------------------------------
def boundary_lengths(max_model_len: int, block_sizes: Iterable[int], budgets: Iterable[int]) -> list[int]:
    """Prompt lengths where a step changes shape, inside [1, max_model_len - 1]."""
    edges = {1, 2, max_model_len // 2, max_model_len - 1}
    for b in itertools.chain(block_sizes, (2 * b for b in block_sizes), budgets):
        edges |= {b - 1, b, b + 1}
    return sorted(n for n in edges if 1 <= n <= max_model_len - 1)


def grid_requests(tokenizer, max_model_len: int, block_sizes: Iterable[int], budgets: Iterable[int],
                  seed: int = 0) -> list[GridRequest]:
    """Greedy prompts at every boundary length, a shared-prefix family with an exact duplicate, and
    two seeded sampled requests with n = 2 (one of them greedy)."""
    block_sizes, budgets = list(block_sizes), list(budgets)
    words = tokenizer(PASSAGE * (max_model_len // 60 + 2)).input_ids
    assert len(words) >= max_model_len, "the passage must cover the context"
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

    def cut(n: int, offset: int) -> list[int]:
        start = offset % max(1, len(words) - n)
        return words[start:start + n]

    def params(p: SamplingParams, n: int) -> SamplingParams:
        return replace(p, max_tokens=min(p.max_tokens, max_model_len - n))

    reqs = [GridRequest(cut(n, 7 * i), params(greedy, n))
            for i, n in enumerate(boundary_lengths(max_model_len, block_sizes, budgets))]
    # a family sharing 2.5 of the largest blocks, and the first of them again (a full prefix hit)
    shared = cut(min(max(block_sizes) * 5 // 2, max_model_len // 2), 11)
    for i in range(3):
        tail = cut(5 + 3 * i, 100 + 13 * i)
        prompt = (shared + tail)[:max_model_len - 1]
        reqs.append(GridRequest(prompt, params(greedy, len(prompt))))
    reqs.append(reqs[-3])
    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=seed + 1234, max_tokens=MAX_NEW_TOKENS)
    for n, p in ((40, sampled), (9, replace(greedy, n=2))):
        n = min(n, max_model_len - 1)
        reqs.append(GridRequest(cut(n, 31), params(p, n)))
    return reqs


# ---- one engine per point -------------------------------------------------------------------
def blocks_needed(requests: list[GridRequest], block_size: int) -> tuple[int, int]:
    """(all requests at once, the longest alone) in KV blocks."""
    per = [-(-(len(r.prompt_token_ids) + r.params.max_tokens) // block_size) for r in requests]
    return sum(p * r.params.n for p, r in zip(per, requests)), max(per)


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class GridRunner:
    """Runs the requests under grid points, loading the model once per path."""

    def __init__(self, requests: list[GridRequest], max_model_len: int, device: str = "cpu",
                 dtype: str = "float32", model: str | None = None) -> None:
        self.requests, self.max_model_len = requests, max_model_len
        self.device, self.dtype, self.model = device, dtype, model
        self._models: dict[str, object] = {}  # path -> loaded CausalLM
        self._references: dict[str, list[tuple[list[int], str]]] = {}

    def _engine(self, point: GridPoint):
        from minivllm.engine.config_builder import build_engine_config
        from minivllm.engine.llm_engine import LLMEngine
        all_at_once, longest = blocks_needed(self.requests, point.block_size)
        kwargs = dict(model=self.model, device=self.device, dtype=self.dtype, max_model_len=self.max_model_len,
                      block_size=point.block_size, max_num_seqs=point.max_num_seqs,
                      max_num_batched_tokens=point.max_num_batched_tokens,
                      enable_chunked_prefill=point.enable_chunked_prefill,
                      enable_prefix_caching=point.enable_prefix_caching,
                      num_kv_blocks=longest + 1 if point.tiny_kv else all_at_once + 8)
        kwargs.update(GPU_PATHS.get(point.path, {}))
        config = build_engine_config(**kwargs)
        with _env(CPU_PATHS.get(point.path, {})):
            engine = LLMEngine(config, model=self._models.get(point.path))
        self._models.setdefault(point.path, engine.executor.runner.model)
        return engine

    def outputs(self, point: GridPoint) -> tuple[list[tuple[list[int], str]], object]:
        """Every sample's (token ids, finish reason), in request then sample order, and the engine."""
        engine = self._engine(point)
        ids = []
        for r in self.requests:
            rid = engine.next_request_id()
            engine.add_request(rid, {"prompt_token_ids": r.prompt_token_ids}, r.params.clone())
            ids.append(rid)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [(list(c.token_ids), c.finish_reason) for rid in ids for c in final[rid].outputs], engine

    def reference(self, path: str) -> list[tuple[list[int], str]]:
        if path not in self._references:
            # every prompt in the first step (a budget of all their tokens), no cache pressure
            every_token = sum(len(r.prompt_token_ids) * r.params.n for r in self.requests)
            outputs = self.outputs(GridPoint(path=path, max_num_batched_tokens=every_token))[0]
            bad = [reason for _, reason in outputs if reason not in ("stop", "length")]
            if bad:
                raise RuntimeError(f"the unconstrained reference itself ended with {bad} on path {path}")
            self._references[path] = outputs
        return self._references[path]

    def check(self, point: GridPoint) -> PointResult:
        expected = self.reference(point.path)
        t = time.perf_counter()
        got, engine = self.outputs(point)
        seconds = time.perf_counter() - t
        mismatches, bad = [], []
        for i, ((toks, reason), (ref, _)) in enumerate(zip(got, expected)):
            if toks != ref:
                first = next((j for j, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
                mismatches.append(f"sample {i}: differs from token {first}: {toks} != {ref}")
            if reason not in ("stop", "length"):
                bad.append(f"sample {i}: finish_reason {reason!r}")
        bm = engine.block_manager
        result = PointResult(point, mismatches, bad, engine.scheduler.num_preemptions, bm.prefix_hits,
                             bm.num_blocks - bm.num_free_blocks, seconds)
        del engine
        gc.collect()
        return result


# ---- the grid -------------------------------------------------------------------------------
def full_grid(paths: list[str], max_model_len: int) -> list[GridPoint]:
    """Each dimension swept around a constrained base point, then the interacting dimensions
    (budget x chunking x prefix caching x KV pressure x block size) crossed, for every path."""
    points: list[GridPoint] = []
    budgets = [1, 2, 3, 7, 16, 17, 33, 64, 100, max_model_len, 2048]
    for path in paths:
        base = GridPoint(path=path, max_num_batched_tokens=33, max_num_seqs=8)
        points += [replace(base, max_num_batched_tokens=b) for b in budgets]
        points += [replace(base, max_num_seqs=s) for s in (1, 2, 3, 5, 64)]
        for bs, prefix, tiny, b in itertools.product((8, 16, 32), (False, True), (False, True), (7, 64, 2048)):
            points.append(replace(base, block_size=bs, enable_prefix_caching=prefix, tiny_kv=tiny,
                                  max_num_batched_tokens=b))
        for prefix, tiny in itertools.product((False, True), (False, True)):  # unchunked prompts
            points.append(replace(base, enable_chunked_prefill=False, max_num_batched_tokens=max_model_len,
                                  enable_prefix_caching=prefix, tiny_kv=tiny))
    return list(dict.fromkeys(points))


def quick_grid(path: str, max_model_len: int) -> list[GridPoint]:
    """The CI slice: every dimension at its sharpest, a handful of engines."""
    base = GridPoint(path=path, max_num_seqs=8)
    return [
        replace(base, max_num_batched_tokens=1),  # a token a step: prompts sample in their last step only
        replace(base, max_num_batched_tokens=16, block_size=8, enable_prefix_caching=True),  # budget = 2 blocks
        replace(base, max_num_batched_tokens=33, tiny_kv=True),  # preempts constantly
        replace(base, max_num_batched_tokens=64, max_num_seqs=1, block_size=32, enable_prefix_caching=True,
                tiny_kv=True),
        replace(base, max_num_batched_tokens=max_model_len, max_num_seqs=3, enable_chunked_prefill=False,
                enable_prefix_caching=True, tiny_kv=True),
    ]


def run_grid(points: list[GridPoint], runner: GridRunner, log=print) -> list[PointResult]:
    results = []
    for i, point in enumerate(points):
        r = runner.check(point)
        results.append(r)
        log(f"[{i + 1}/{len(points)}] {'ok  ' if r.ok else 'FAIL'} {point.label}: {r.seconds:.1f} s, "
            f"{r.num_preemptions} preemptions, {r.prefix_hit_tokens} prefix-hit tokens"
            + "".join(f"\n    {m}" for m in r.mismatches + r.bad_finishes)
            + (f"\n    {r.leaked_blocks} blocks leaked" if r.leaked_blocks else ""), flush=True)
    return results


def add_parser(sub) -> None:
    p = sub.add_parser("config-grid", help="differential test: tokens equal across step-shaping configurations",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--paths", default=None, help="comma-separated model paths (default: all of the device's)")
    p.add_argument("--quick", action="store_true", help="only the CI slice")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(bench_func=cmd_config_grid)


def cmd_config_grid(args) -> int:
    from minivllm.engine.tokenizer import load_tokenizer
    from minivllm.engine.config_builder import build_engine_config
    paths = args.paths.split(",") if args.paths else list(CPU_PATHS if args.device == "cpu" else GPU_PATHS)
    cfg = build_engine_config(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    grid = [p for path in paths for p in quick_grid(path, args.max_model_len)] if args.quick else full_grid(paths, args.max_model_len)
    requests = grid_requests(load_tokenizer(cfg.model), args.max_model_len, {p.block_size for p in grid},
                             {p.max_num_batched_tokens for p in grid})
    runner = GridRunner(requests, args.max_model_len, args.device, args.dtype, args.model)
    results = run_grid(grid, runner)
    failed = [r for r in results if not r.ok]
    summary = {"points": len(results), "failed": len(failed), "requests": len(requests),
               "samples": sum(r.params.n for r in requests), "device": args.device,
               "results": [{**asdict(r.point), "ok": r.ok, "mismatches": r.mismatches, "bad_finishes": r.bad_finishes,
                            "preemptions": r.num_preemptions, "prefix_hit_tokens": r.prefix_hit_tokens,
                            "leaked_blocks": r.leaked_blocks, "seconds": round(r.seconds, 2)} for r in results]}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    return 1 if failed else 0
