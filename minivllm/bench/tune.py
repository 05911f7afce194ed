"""`minivllm bench tune`: the serving settings that give the most goodput under a latency SLO.

    minivllm bench tune --model M --slo ttft_p99=500ms,itl_p99=50ms --workload W3 \\
        [--rates 4,16,64] [--max-num-seqs 64,128,256] [--max-num-batched-tokens 2048,8192] \\
        [--serve-args "--gpu-memory-utilization 0.9"] [--output tune.json] [--plot tune.png]

For every candidate (max_num_seqs x max_num_batched_tokens) a `minivllm serve` process starts
with those settings; the W3 serving benchmark (server/bench_serve.py) runs against it at every
rate. A row meets the SLO when each named percentile over all its requests is within its
target; its goodput is the requests/s whose own TTFT / p99 inter-token gap / ... met every target
(bench serve's --goodput). The best row is the one of most goodput among those that meet the
SLO; it is printed as a ready `minivllm serve` command. Results: JSON and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

from tqdm import tqdm

from minivllm.bench.common import log

SLO_METRICS = {"ttft": "ttft_ms", "itl": "itl_ms", "tpot": "tpot_ms", "e2el": "e2e_latency_ms"}
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def parse_slo(text: str) -> dict[str, tuple[float, float]]:
    """"ttft_p99=500ms,itl_p99=50ms" -> {"ttft": (99.0, 0.5), "itl": (99.0, 0.05)} (seconds)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        metric, _, pct = name.partition("_p")
        if not sep or metric not in SLO_METRICS or not pct.replace(".", "", 1).isdigit():
            raise ValueError(f"--slo items are METRIC_pNN=VALUE with METRIC in {sorted(SLO_METRICS)}, got {item!r}")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if value.endswith(u)), None)
        try:
            seconds = float(value[:-len(unit)] if unit else value) * _UNITS[unit or "ms"]
        except ValueError:
            raise ValueError(f"--slo {item!r}: {value!r} is not a duration (500ms, 0.5s)") from None
        if not seconds > 0 or not 0 < float(pct) <= 100:
            raise ValueError(f"--slo {item!r}: the target must be > 0 and the percentile in (0, 100]")
        out[metric] = (float(pct), seconds)
    if not out:
        raise ValueError("--slo names no target")
    return out


def slo_met(figures: dict, slo: dict[str, tuple[float, float]]) -> bool:
    if figures["requests_failed"]:
        return False
    for metric, (pct, seconds) in slo.items():
        value = figures[SLO_METRICS[metric]].get(f"p{int(pct) if pct.is_integer() else pct}")
        if value is not None and value > 1e3 * seconds:
            return False
    return True


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rates(text: str) -> list[float]:
    return [math.inf if x.strip() == "inf" else float(x) for x in text.split(",") if x.strip()]


def serve_command(model: str | None, seqs: int, tokens: int, serve_args: list[str]) -> list[str]:
    """The `minivllm serve` arguments of one candidate (without host and port)."""
    cmd = ["minivllm", "serve"] + ([model] if model else [])
    return cmd + ["--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens), *serve_args]


class _Server:
    """One candidate's `minivllm serve` process on a free port, its log in log_path."""

    def __init__(self, argv: list[str], log_path: str, startup_timeout_s: float) -> None:
        from minivllm.server.testing import free_port
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "minivllm", *argv[1:], "--port", str(self.port), "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_healthy(startup_timeout_s, log_path)

    def _wait_healthy(self, timeout_s: float, log_path: str) -> None:
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: drains, then exits
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def bench_args(args: argparse.Namespace, base_url: str, rate: float) -> argparse.Namespace:
    """bench serve's options for one run: the W3 workload (sized by the tune flags) at `rate`."""
    from minivllm.server.bench_serve import add_bench_serve_args
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    pcts = sorted({99.0, 50.0, *(pct for pct, _ in args.slo_targets.values())})
    goodput = [f"{m}:{1e3 * s:g}" for m, (_, s) in args.slo_targets.items()]
    argv = ["--base-url", base_url, "--num-requests", str(args.num_requests), "--request-rate", str(rate),
            "--seed", str(args.seed), "--input-len", *map(str, args.input_len), "--output-len", *map(str, args.output_len),
            "--percentiles", *map(str, pcts), "--goodput", *goodput, "--no-progress", "--engine-label", "minivllm"]
    return p.parse_args(argv)


def run_candidate(args, seqs: int, tokens: int, bar) -> list[dict]:
    """Starts the candidate's server, runs every rate against it, stops it: one row per rate."""
    from minivllm.server.bench_serve import run_benchmark
    argv = serve_command(args.model, seqs, tokens, args.serve_args)
    log_path = os.path.join(args.log_dir, f"serve-seqs{seqs}-tokens{tokens}.log")
    server = _Server(argv, log_path, args.startup_timeout)
    rows = []
    try:
        for rate in args.rate_list:
            bar.set_postfix_str(f"max_num_seqs={seqs} max_num_batched_tokens={tokens} rate={rate}")
            figures = asyncio.run(run_benchmark(bench_args(args, server.base_url, rate)))["figures"]
            rows.append({"max_num_seqs": seqs, "max_num_batched_tokens": tokens, "request_rate": rate,
                         "meets_slo": slo_met(figures, args.slo_targets), "goodput_per_s": figures["goodput_per_s"],
                         "serve_command": shlex.join(argv), "figures": figures})
            bar.update(1)
    finally:
        server.stop()
    return rows


def best_row(rows: list[dict]) -> dict | None:
    """Most goodput among the rows that meet the SLO (ties: the fewer sequences, then tokens)."""
    ok = [r for r in rows if r["meets_slo"]]
    return max(ok, key=lambda r: (r["goodput_per_s"] or 0.0, -r["max_num_seqs"], -r["max_num_batched_tokens"]),
               default=None)


def table(rows: list[dict], slo: dict[str, tuple[float, float]]) -> str:
    keys = [(m, pct) for m, (pct, _) in slo.items()]
    head = ["max_num_seqs", "max_batched_tokens", "rate/s", "goodput/s", "req/s",
            *(f"{m}_p{pct:g} ms" for m, pct in keys), "meets SLO"]
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for r in rows:
        f = r["figures"]
        lat = [f[SLO_METRICS[m]].get(f"p{pct:g}") for m, pct in keys]
        cells = [r["max_num_seqs"], r["max_num_batched_tokens"], r["request_rate"], _num(r["goodput_per_s"]),
                 _num(f["request_throughput_per_s"]), *map(_num, lat), "yes" if r["meets_slo"] else "no"]
        lines.append("  ".join(f"{c!s:>14}" for c in cells))
    return "\n".join(lines)


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = sorted({r["request_rate"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in sorted({(r["max_num_seqs"], r["max_num_batched_tokens"]) for r in rows}):
        mine = sorted((r for r in rows if (r["max_num_seqs"], r["max_num_batched_tokens"]) == key),
                      key=lambda r: r["request_rate"])
        ax.plot([rates.index(r["request_rate"]) for r in mine], [r["goodput_per_s"] or 0.0 for r in mine],
                marker="o", label=f"max_num_seqs={key[0]}, max_num_batched_tokens={key[1]}")
    ax.set_xticks(range(len(rates)), [str(r) for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting the SLO)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_tune(args: argparse.Namespace) -> int:
    args.slo_targets = parse_slo(args.slo)
    args.rate_list = _rates(args.rates)
    seqs, tokens = _ints(args.max_num_seqs), _ints(args.max_num_batched_tokens)
    if not (seqs and tokens and args.rate_list) or min(seqs + tokens) < 1 or min(args.rate_list) <= 0:
        raise ValueError("--max-num-seqs, --max-num-batched-tokens and --rates need positive values")
    args.serve_args = shlex.split(args.serve_args or "")
    os.makedirs(args.log_dir, exist_ok=True)
    rows: list[dict] = []
    with tqdm(total=len(seqs) * len(tokens) * len(args.rate_list), desc="tune", unit="run", file=sys.stderr) as bar:
        for s in seqs:
            for t in tokens:
                rows += run_candidate(args, s, t, bar)
    best = best_row(rows)
    print(table(rows, args.slo_targets), file=sys.stderr)
    result = {"slo": args.slo, "workload": args.workload, "rates": args.rate_list, "rows": rows, "best": best,
              "best_serve_command": best["serve_command"] if best else None,
              "best_request_rate": best["request_rate"] if best else None}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1, default=str)
    if args.plot:
        plot(rows, args.plot, f"{args.workload} goodput, SLO {args.slo}")
    if best is None:
        log(f"no setting met the SLO {args.slo} at any rate: try lower --rates or more candidates")
    else:
        log(f"best: {best['goodput_per_s']:.2f} req/s goodput at {best['request_rate']} req/s with\n  "
            f"{best['serve_command']}")
    print(json.dumps({k: result[k] for k in ("slo", "best_serve_command", "best_request_rate")}), flush=True)
    return 0 if best is not None else 1


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="goodput of serving settings under a latency SLO; prints the best as a serve command")
    p.add_argument("--model", default=None, help="the model to serve (default: the bundled default)")
    p.add_argument("--slo", required=True, help="targets, e.g. ttft_p99=500ms,itl_p99=50ms (ttft, itl, tpot, e2el)")
    p.add_argument("--workload", default="W3", choices=["W3"], help="the serving workload (BENCHMARKS.md)")
    p.add_argument("--rates", default="4,16,64", help="request rates (req/s, Poisson; inf: all at once)")
    p.add_argument("--max-num-seqs", default="64,128,256", help="candidate values, comma-separated")
    p.add_argument("--max-num-batched-tokens", default="2048,8192", help="candidate values, comma-separated")
    p.add_argument("--serve-args", default="", help="more `minivllm serve` flags for every candidate (one string)")
    p.add_argument("--num-requests", type=int, default=1000, help="requests per run (W3: 1,000)")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--output", default="tune.json", help="the results as JSON")
    p.add_argument("--plot", default="tune.png", help="goodput per rate and candidate (PNG; empty: none)")
    p.add_argument("--log-dir", default="tune-logs", help="each candidate server's log")
    p.set_defaults(bench_func=cmd_tune)
