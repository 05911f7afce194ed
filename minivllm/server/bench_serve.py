"""W3 online serving benchmark against any OpenAI-compatible server (minivllm, vLLM, ...).

    python -m minivllm.server.bench_serve --base-url http://127.0.0.1:8000 --request-rate 16
    minivllm bench serve ...            (through register_bench_serve(bench_subparsers))

Workload (BENCHMARKS.md W3): random.seed(seed); for each request a prompt of U[100, 1024]
random token ids in [0, 10000), then for each request max_tokens U[100, 1024] (prompts first,
then output lengths, as W1 draws them); sent as token-id prompts to /v1/completions with
ignore_eos, temperature 0 and streaming; Poisson arrivals at --request-rate (inf: all at once;
the gaps come from their own RNG seeded with the same seed), optionally at most
--max-concurrency in flight. Prints one JSON object: TTFT, inter-token latency, TPOT and
end-to-end latency (mean, p50/p90/p99 in ms), output tokens/s, requests finished and failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from minivllm.bench.observe import ServerObserver, add_observe_args


@dataclass
class BenchRequest:
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds from send to the first token
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carry a choice
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0


def make_workload(num_requests: int, seed: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(*input_range))] for _ in range(num_requests)]
    outs = [rng.randint(*output_range) for _ in range(num_requests)]
    return [BenchRequest(p, o) for p, o in zip(prompts, outs)]


def running_context_lengths(n: int, rng: random.Random, input_range: tuple[int, int] = (100, 1024),
                            output_range: tuple[int, int] = (100, 1024)) -> list[int]:
    """Context lengths of n requests caught mid-decode in W3 (for GPU probes of a steady
    state): a prompt from input_range plus a uniform part of an output from output_range."""
    return [rng.randint(*input_range) + rng.randint(0, rng.randint(*output_range)) for _ in range(n)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (Poisson process at `rate`/s)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                   headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_tokens=len(req.prompt))
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            done = await _read_events(r, res, start)
        res.e2e = time.perf_counter() - start
        res.ok = done and res.output_tokens >= req.max_tokens
        if not res.ok and res.error is None:
            res.error = f"incomplete: {res.output_tokens} of {req.max_tokens} tokens, [DONE] seen: {done}"
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _read_events(r: httpx.Response, res: RequestResult, start: float) -> bool:
    """Consumes the SSE stream; returns whether it ended with [DONE]."""
    streamed_tokens, last = 0, start
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if res.output_tokens == 0:
                res.output_tokens = streamed_tokens
            return True
        event = json.loads(data)
        if "error" in event:
            res.error = str(event["error"])[:300]
            continue
        if event.get("usage"):
            res.output_tokens = event["usage"].get("completion_tokens", 0)
        # every chunk carrying a choice is a step's worth of tokens (as vLLM's benchmark counts
        # them): its text may be empty (held back, or a server without a tokenizer)
        if event.get("choices"):
            now = time.perf_counter()
            if res.ttft is None:
                res.ttft = now - start
            else:
                res.itl.append(now - last)
            last = now
            streamed_tokens += 1
    return False


async def run_benchmark(args: argparse.Namespace) -> dict:
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await _first_model(client, args.base_url, headers)
        work = make_workload(args.num_requests, args.seed, tuple(args.input_len), tuple(args.output_len),
                             args.vocab_size)
        offsets = arrival_offsets(len(work), args.request_rate, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        observer = ServerObserver(args, client, headers)
        await observer.start()
        bar = tqdm(total=len(work), desc="W3 requests", unit="req", disable=not args.progress, file=sys.stderr)
        t0 = time.perf_counter()

        async def launch(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            if sem is None:
                res = await send_one(client, url, model, req, headers)
            else:
                async with sem:
                    res = await send_one(client, url, model, req, headers)
            bar.update(1)
            return res

        results = await asyncio.gather(*(launch(r, at) for r, at in zip(work, offsets)))
        duration = time.perf_counter() - t0
        bar.close()
        await observer.finish(f"W3 at {args.request_rate} req/s on {model}")
    return summarize(args, model, work, results, duration)


async def _first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _stats(xs: list[float], percentiles: list[float]) -> dict:
    if not xs:
        return {"mean": None, **{f"p{_pname(p)}": None for p in percentiles}}
    s = sorted(xs)
    out = {"mean": 1e3 * sum(s) / len(s)}
    for p in percentiles:
        k = (len(s) - 1) * p / 100.0  # linear interpolation, as numpy.percentile
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{_pname(p)}"] = 1e3 * (s[lo] + (s[hi] - s[lo]) * (k - lo))
    return out


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(args: argparse.Namespace, model: str, work: list[BenchRequest], results: list[RequestResult],
              duration: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = args.percentiles
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    goodput = parse_goodput(args.goodput) if getattr(args, "goodput", None) else None
    figures = {
        "requests_finished": len(ok), "requests_failed": len(results) - len(ok), "duration_s": duration,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "request_throughput_per_s": len(ok) / duration if duration > 0 else None,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None], pct),
        "itl_ms": _stats([x for r in ok for x in r.itl], pct),
        "tpot_ms": _stats(tpot, pct),
        "e2e_latency_ms": _stats([r.e2e for r in ok if r.e2e is not None], pct),
    }
    if goodput is not None:  # requests/s that met every per-request target (vLLM's --goodput)
        good = sum(meets_goodput(r, goodput) for r in ok)
        figures["goodput_per_s"] = good / duration if duration > 0 else None
        figures["goodput_requests"] = good
    return {
        "workload": "W3", "engine": args.engine_label, "model": model, "base_url": args.base_url,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv),
        "settings": {"num_requests": args.num_requests, "request_rate": args.request_rate,
                     "max_concurrency": args.max_concurrency, "seed": args.seed, "input_len": args.input_len,
                     "output_len": args.output_len, "vocab_size": args.vocab_size, "endpoint": args.endpoint},
        "workload_summary": {"total_input_tokens": sum(len(w.prompt) for w in work),
                             "total_output_tokens_requested": sum(w.max_tokens for w in work),
                             "total_output_tokens_received": out_tokens},
        "figures": figures,
        "details": {"first_errors": errors[:5]},
    }


GOODPUT_KEYS = ("ttft", "tpot", "e2el", "itl")  # vLLM's three, and ours: the request's p99 gap


def parse_goodput(items: list[str]) -> dict[str, float]:
    """vLLM's --goodput KEY:MS ...: {key: seconds}; ValueError naming a bad item."""
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY in {GOODPUT_KEYS}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the target must be > 0 ms")
        out[key] = ms / 1e3
    return out


def meets_goodput(r: RequestResult, targets: dict[str, float]) -> bool:
    """Whether one finished request met every target (seconds)."""
    values = {"ttft": r.ttft, "e2el": r.e2e,
              "tpot": (r.e2e - r.ttft) / (r.output_tokens - 1) if r.ttft is not None and r.output_tokens > 1 else 0.0,
              "itl": sorted(r.itl)[min(len(r.itl) - 1, round(0.99 * (len(r.itl) - 1)))] if r.itl else 0.0}
    return all(values[k] is not None and values[k] <= t for k, t in targets.items())


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the first of the server's /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--vocab-size", type=int, default=10000, help="prompt token ids are drawn from [0, this)")
    p.add_argument("--percentiles", type=float, nargs="+", default=[50.0, 90.0, 99.0])
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="per-request targets (vLLM's): ttft, tpot, e2el, itl (the request's p99 gap), in ms; "
                        "adds goodput_per_s, the requests/s that met them all")
    p.add_argument("--engine-label", default="openai-server", help="the 'engine' field of the JSON result")
    p.add_argument("--output-json", default=None, help="also write the result to this file")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar of finished requests on stderr")
    add_observe_args(p)  # --timeline (from a minivllm server's dashboard events), --profile (its --profile-dir)


def validate_args(args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.goodput:
        parse_goodput(args.goodput)
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            raise ValueError(f"--{name.replace('_', '-')} must be 1 <= MIN <= MAX, got {lo} {hi}")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    validate_args(args)
    result = asyncio.run(run_benchmark(args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0 if result["figures"]["requests_failed"] == 0 else 1


def register_bench_serve(subparsers) -> None:
    """Adds `serve` to the `minivllm bench` sub-commands."""
    p = subparsers.add_parser("serve", help="W3: online serving benchmark against an OpenAI-compatible server")
    add_bench_serve_args(p)
    p.set_defaults(func=cmd_bench_serve, bench_func=cmd_bench_serve)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.server.bench_serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_args(p)
    args = p.parse_args(argv)
    try:
        return cmd_bench_serve(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
