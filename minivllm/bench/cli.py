"""`minivllm bench ...`: registered into the main CLI by minivllm.cli.

    minivllm bench throughput --workload W1|W1-8B|W4 [--no-prefix-caching] [--enforce-eager] ...
    minivllm bench latency --workload W2 [--model-config llama-3.1-8b]
    minivllm bench startup [--model-config qwen3-0.6b]
    minivllm bench cpu
    minivllm bench config-grid [--device cuda] [--quick]   (a differential test, not a timing)
    minivllm bench spec --model HF_DIR [--methods ...]      (W8, speculative decoding)
    minivllm bench soak [--requests 10000]                  (soak and fault suite: nothing lost)
    minivllm bench tune --slo ttft_p99=500ms,itl_p99=50ms    (serving settings of most goodput under an SLO)
    minivllm bench invariance [--batch-invariant]           (one prompt under random load: distinct outputs)
    minivllm bench parallel-check --layouts tp1,tp2,pp2      (sharded layouts vs tp=1 on the same weights)
    minivllm bench tp-steps --tp 1,3                         (per-step time at each tensor_parallel_size)
    minivllm bench perplexity [--variants fp32,awq,...]      (the default model in each quantized format)

Every sub-command prints one JSON object (see minivllm.bench.common). The peers run through
their own modules (python -m minivllm.bench.peers.vllm_runner / hf_runner) and the GPU driver
is python -m minivllm.bench.compare.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from minivllm.bench import (config_grid, cpu_bench, invariance, parallel_check, perplexity, run_minivllm, soak,
                                spec_bench, startup, tune)
    from minivllm.server.bench_serve import register_bench_serve
    b = subparsers.add_parser("bench", help="benchmarks: throughput, latency, startup, cpu, serve",
                              description="The standard workloads of BENCHMARKS.md on minivllm.")
    sub = b.add_subparsers(dest="bench_command", required=True)
    run_minivllm.add_parsers(sub)
    s = sub.add_parser("startup", help="W6: seconds from process start to the first generated token")
    startup.add_startup_args(s)
    s.set_defaults(bench_func=lambda a: startup.cmd_startup(a, "minivllm"))
    cpu_bench.add_parser(sub)
    config_grid.add_parser(sub)
    spec_bench.add_parser(sub)  # W8
    soak.add_parser(sub)  # the soak and fault suite (issue 22)
    invariance.add_parser(sub)  # batch invariance under load (issue 22)
    register_bench_serve(sub)  # W3, against any OpenAI-compatible server
    tune.add_parser(sub)  # the serving settings of most goodput under an SLO
    parallel_check.add_parser(sub)  # tp/pp layouts vs tp=1 on the same weights (issue 27)
    parallel_check.add_tp_steps_parser(sub)  # per-step time at tp=N (issue 20)
    perplexity.add_parser(sub)  # quality of the quantized formats (issue 25)
    b.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    return args.bench_func(args)
