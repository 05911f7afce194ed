"""The soak and fault suite: thousands of mixed requests against the server, with random client
aborts and disconnects, a KV cache small enough to preempt constantly, and injected faults (failing
steps, requests at fault, a killed engine core); it checks that nothing is lost.

    minivllm bench soak [--requests 10000] [--concurrency 64] [--output FILE]

Phase 1 (soak): the server's default engine (the engine core in its own process) with a tiny KV
cache and MINIVLLM_FAULT_INJECTION; every request is one of: completions or chat, streaming or not,
n of 1-3, stop strings, short or long prompts and outputs, random sampling settings; some are
abandoned by their client (a stream closed after a few chunks, a request cancelled). Each must end
as `complete` (every choice with finish_reason stop or length and a body that adds up), `error` (an
OpenAI error status or error event, or finish_reason "error" from an injected fault), or
`abandoned` (by the client); anything else is `lost`. Afterwards the engine must be idle with every
KV block free, and the engine core's resident memory must not have grown past --rss-slack-mb
between the first tenth of the run and the end.

Phase 2 (kill): requests in flight, the engine core killed: every one of them must get an error
within a second, and /health must answer 503.

Prints one JSON object with the counts; exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

WORDS = ("the river runs past an old mill where bread was baked for the town every morning before dawn "
         "and children carried the loaves home in baskets lined with cloth").split()


@dataclass
class SoakReport:
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rss_mb: tuple[float, float] = (0.0, 0.0)  # engine core after warm-up, at the end
    kill: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and self.outcomes["lost"] == 0


def _prompt(rng: random.Random) -> str:
    n = rng.choice([3, 8, 20, 60, 200])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_request(rng: random.Random, model: str) -> tuple[str, dict, int | None]:
    """(path, body, chunks after which the client disconnects or None)."""
    chat = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.choice([1, 2, 4, 8, 16, 32, 64]), "n": rng.choice([1, 1, 1, 2, 3]),
                  "stream": rng.random() < 0.5, "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.2:
        body["top_k"] = rng.choice([5, 50])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        body["logprobs"] = True if chat else 2
        if chat:
            body["top_logprobs"] = 2
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    disconnect = rng.randint(1, 4) if (body["stream"] and rng.random() < 0.1) else None
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, disconnect


def classify(status: int, payload, body: dict) -> str:
    """complete / error / lost for a finished (non-abandoned) exchange."""
    if status >= 400:
        return "error" if isinstance(payload, dict) and "error" in payload else "lost"
    choices = payload.get("choices") or []
    if len(choices) != body["n"]:
        return "lost"
    reasons = {c.get("finish_reason") for c in choices}
    if "error" in reasons or "abort" in reasons:
        return "error"
    if not reasons <= {"stop", "length"}:
        return "lost"
    usage = payload.get("usage") or {}
    if usage.get("completion_tokens", -1) > body["max_tokens"] * body["n"]:
        return "lost"
    return "complete"


async def _one(client, base: str, path: str, body: dict, disconnect: int | None) -> str:
    import httpx
    try:
        if not body["stream"]:
            r = await client.post(base + path, json=body)
            return classify(r.status_code, r.json(), body)
        return await _stream(client, base + path, body, disconnect)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return f"lost: {type(e).__name__}: {e}"


async def _stream(client, url: str, body: dict, disconnect: int | None) -> str:
    """A streamed request folded into what a non-streamed one returns, then classified."""
    choices: dict[int, dict] = {}
    usage, chunks = None, 0
    async with client.stream("POST", url, json=dict(body, stream_options={"include_usage": True})) as r:
        if r.status_code >= 400:
            return classify(r.status_code, json.loads(await r.aread()), body)
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return "error"
            chunks += 1
            if disconnect is not None and chunks >= disconnect:
                return "abandoned"  # leaving the block closes the connection mid-stream
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                choices.setdefault(c["index"], {})["finish_reason"] = c.get("finish_reason") or \
                    choices.get(c["index"], {}).get("finish_reason")
        if not done:
            return "lost: no [DONE]"
    payload = {"choices": [choices[i] for i in sorted(choices)], "usage": usage}
    return classify(200, payload, body)


async def run_soak(base: str, model: str, n: int, concurrency: int, seed: int, cancel_rate: float,
                   on_progress=None) -> tuple[Counter, list[str]]:
    """Outcome counts, and the first lost requests' descriptions."""
    import httpx
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    lost: list[str] = []
    todo = [random_request(rng, model) for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def worker(i: int, spec) -> None:
        async with sem:
            task = asyncio.ensure_future(_one(client, base, *spec))
            if rng.random() < cancel_rate:  # the client gives up on a request while it runs
                await asyncio.sleep(rng.uniform(0.0, 0.5))
                task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                result = "abandoned"
            outcomes[result.split(":")[0]] += 1
            if result.startswith("lost") and len(lost) < 5:
                lost.append(f"{spec[0]} {spec[1]}: {result}")
            if on_progress is not None:
                on_progress(sum(outcomes.values()))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        await asyncio.gather(*(worker(i, spec) for i, spec in enumerate(todo)))
    return outcomes, lost


def _rss_mb(pid: int) -> float:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


def _wait_idle(engine, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_kv_blocks:
            return True
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def _served(engine_kwargs: dict, faults: dict | None):
    from minivllm.engine.faults import ENV
    from minivllm.engine.mp_async_engine import MPAsyncEngine
    from minivllm.server.app import create_app
    from minivllm.server.serving_common import ServerSettings
    from minivllm.server.testing import ServerThread
    old = os.environ.get(ENV)
    if faults:
        os.environ[ENV] = json.dumps(faults)  # the engine-core process inherits it
    try:
        engine = MPAsyncEngine.from_kwargs(**engine_kwargs)
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False, max_n=3))).start()
    try:
        yield engine, server
    finally:
        server.stop()
        engine.shutdown()


def soak(args) -> SoakReport:
    report = SoakReport()
    on_gpu = args.device.startswith("cuda")
    kw = dict(dtype="bfloat16" if on_gpu else "float32", device=args.device, max_model_len=1024, num_kv_blocks=args.kv_blocks,
              max_num_seqs=args.concurrency, enable_prefix_caching=True)
    faults = {"step_failure_rate": args.step_failure_rate, "request_failure_rate": args.request_failure_rate,
              "seed": args.seed}
    with _served(kw, faults) as (engine, server):
        pid, model = engine._proc.pid, engine.config.model.served_name
        marks: dict[str, float] = {}

        def progress(done: int) -> None:
            if done >= max(1, args.requests // 10) and "rss0" not in marks:
                marks["rss0"] = _rss_mb(pid)

        t0 = time.monotonic()
        report.outcomes, lost = asyncio.run(run_soak(server.base_url, model, args.requests, args.concurrency,
                                                     args.seed, args.cancel_rate, progress))
        report.problems += [f"lost: {x}" for x in lost]
        report.seconds = time.monotonic() - t0
        if not _wait_idle(engine):
            report.problems.append(f"engine not idle after the soak: {engine.get_stats()}")
        report.rss_mb = (round(marks.get("rss0", 0.0), 1), round(_rss_mb(pid), 1))
        if report.rss_mb[1] - report.rss_mb[0] > args.rss_slack_mb:
            report.problems.append(f"engine core RSS grew {report.rss_mb} MB (slack {args.rss_slack_mb})")
        stats = engine.get_stats()
        report.outcomes["preemptions"] = stats.num_preemptions
    report.kill = kill_phase(kw)
    if not report.kill.get("ok"):
        report.problems.append(f"kill phase: {report.kill}")
    if report.outcomes["lost"]:
        report.problems.append(f"{report.outcomes['lost']} requests lost")
    return report


def kill_phase(kw: dict, num_requests: int = 16) -> dict:
    """Requests in flight when the engine core dies: each gets an error within a second."""
    import httpx
    with _served(kw, None) as (engine, server):
        model = engine.config.model.served_name

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                tasks = [asyncio.ensure_future(_stream(client, server.base_url + "/v1/completions", body, None))
                         for _ in range(num_requests)]
                while engine.get_stats().num_running < 1:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                engine._proc.kill()
                t = time.monotonic()
                results = await asyncio.gather(*tasks)
                return results, time.monotonic() - t

        results, seconds = asyncio.run(main())
        health = httpx.get(server.base_url + "/health").status_code
    errors = sum(r == "error" for r in results)
    return {"requests": num_requests, "errors": errors, "seconds_to_all_errors": round(seconds, 3),
            "health": health, "ok": errors == num_requests and seconds < 1.0 and health == 503}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--kv-blocks", type=int, default=160, help="a cache small enough to preempt constantly")
    p.add_argument("--step-failure-rate", type=float, default=0.005)
    p.add_argument("--request-failure-rate", type=float, default=0.01)
    p.add_argument("--cancel-rate", type=float, default=0.05, help="requests the client cancels while they run")
    p.add_argument("--rss-slack-mb", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16; the 10,000-request run on a GPU)")
    p.add_argument("--output", default=None)


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="soak and fault suite: mixed requests, aborts, faults; nothing may be lost")
    add_args(p)
    p.set_defaults(bench_func=cmd_soak)


def cmd_soak(args) -> int:
    report = soak(args)
    out = {"requests": args.requests, "concurrency": args.concurrency, "seconds": round(report.seconds, 1),
           "outcomes": dict(report.outcomes), "engine_core_rss_mb": report.rss_mb, "kill": report.kill,
           "problems": report.problems, "ok": report.ok}
    from minivllm.bench.common import emit
    emit(out, args.output)
    return 0 if report.ok else 1
