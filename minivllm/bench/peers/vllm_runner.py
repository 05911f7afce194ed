"""The standard workloads on vLLM (the peer), printing the same JSON as minivllm's runners.

Run it in its own process with vLLM importable (on the GPU machine: PYTHONPATH=/tmp/vllm-site
plus the repository root for minivllm.bench), never in one process with minivllm's engine:

    python3 -m minivllm.bench.peers.vllm_runner throughput --workload W1 [--repeats 2]
    python3 -m minivllm.bench.peers.vllm_runner throughput --workload W1-8B
    python3 -m minivllm.bench.peers.vllm_runner throughput --workload W4 [--no-prefix-caching]
    python3 -m minivllm.bench.peers.vllm_runner latency --workload W2
    python3 -m minivllm.bench.peers.vllm_runner throughput --workload W10 --moe-backend triton
    python3 -m minivllm.bench.peers.vllm_runner startup --model-config qwen3-0.6b
    python3 -m minivllm.bench.peers.vllm_runner throughput --workload W1 --dry-run   # no vLLM needed

As in ../shared/peers/vllm-0.20.0/bench_w1.py: dummy weights (`load_format="dummy"`),
`skip_tokenizer_init=True`, prompts as {"prompt_token_ids": ...}, `seed=0`, vLLM's defaults
otherwise (FlashAttention 3, torch.compile, CUDA graphs, async scheduling, chunked prefill,
prefix caching). W4's TTFT comes from driving `llm.llm_engine` step by step with
RequestOutputKind.DELTA (arrival = just before add_request, first token = the step that returns
it, both time.perf_counter()), the client's view, as minivllm's RequestOutput.metrics give it;
W4's hit rate from RequestOutput.num_cached_tokens / prompt tokens. vLLM is imported lazily:
this module imports without it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from minivllm.bench import drive, model_dirs, workloads
from minivllm.bench.api_variants import add_api_args, lora_engine_kwargs
from minivllm.bench.common import (add_common_engine_args, add_workload_args, emit_all, envelope, log,
                                   quant_engine_kwargs)
from minivllm.bench.procedures import GenResult


class VllmAdapter:
    engine = "vllm"

    def __init__(self, model_dir: str, *, max_model_len: int, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, enable_prefix_caching: bool = True, seed: int = 0, **extra) -> None:
        import vllm
        from vllm import LLM
        self.version = vllm.__version__
        self.kwargs = llm_kwargs(model_dir, max_model_len, gpu_memory_utilization, enforce_eager,
                                 enable_prefix_caching, seed, extra)
        t = time.perf_counter()
        self.llm = LLM(**self.kwargs)
        self.startup_s = time.perf_counter() - t
        self._batches = itertools.count()
        self.stream_error: str | None = None
        self._closed = False

    def prepare(self, params: list[dict]) -> list:
        from vllm import SamplingParams
        return [SamplingParams(**p) for p in params]

    def generate(self, prompts: list[dict], prepared: list, want_ttft: bool = False) -> list[GenResult]:
        if want_ttft and self.stream_error is None:
            try:
                return self._generate_streaming(prompts, prepared)
            except Exception as e:  # noqa: BLE001  (an engine API change: fall back, say so)
                self.stream_error = repr(e)
                log(f"WARNING: step-by-step TTFT failed ({e!r}); falling back to LLM.generate (no TTFT)")
                self._drain()
        from minivllm.bench import api_variants
        if getattr(self, "beam_width", 0):
            from vllm.sampling_params import BeamSearchParams
            params = BeamSearchParams(beam_width=self.beam_width, max_tokens=prepared[0].max_tokens, ignore_eos=True)
            return api_variants.beam_results(self.llm.beam_search(prompts, params), prompts)
        loras = None
        if getattr(self, "lora_paths", None):
            from vllm.lora.request import LoRARequest
            loras = api_variants.lora_list(self, LoRARequest, len(prompts))
        outs = self.llm.generate(prompts, prepared, use_tqdm=False, lora_request=loras)
        return [GenResult(len(o.outputs[0].token_ids), len(o.prompt_token_ids), getattr(o, "num_cached_tokens", None),
                          _metrics_ttft(o)) for o in outs]

    def _generate_streaming(self, prompts: list[dict], prepared: list) -> list[GenResult]:
        from vllm.sampling_params import RequestOutputKind
        eng = self.llm.llm_engine
        b = next(self._batches)
        n = len(prompts)
        index: dict[str, int] = {}
        arrival, first = [0.0] * n, [None] * n
        counts, cached = [0] * n, [None] * n
        for i, (p, sp) in enumerate(zip(prompts, prepared)):
            sp = sp.clone()
            sp.output_kind = RequestOutputKind.DELTA
            rid = f"bench{b}r{i}"  # no '-': vLLM may append '-<suffix>' to make an internal id
            index[rid] = i
            arrival[i] = time.perf_counter()
            ret = eng.add_request(rid, p, sp)
            if isinstance(ret, str):
                index[ret] = i
        done = 0
        while done < n:
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                i = index.get(o.request_id, index.get(str(o.request_id).rsplit("-", 1)[0]))
                if i is None:
                    continue
                k = sum(len(c.token_ids) for c in o.outputs)
                if k and first[i] is None:
                    first[i] = now
                counts[i] += k
                if getattr(o, "num_cached_tokens", None) is not None:
                    cached[i] = o.num_cached_tokens
                if o.finished:
                    done += 1
            if not outs and not eng.has_unfinished_requests():
                break
        if done < n:
            raise RuntimeError(f"only {done} of {n} requests finished")
        return [GenResult(counts[i], len(prompts[i]["prompt_token_ids"]), cached[i],
                          None if first[i] is None else first[i] - arrival[i]) for i in range(n)]

    def _drain(self) -> None:
        eng = self.llm.llm_engine
        try:
            while eng.has_unfinished_requests():
                eng.step()
        except Exception:  # noqa: BLE001
            pass

    def reset_prefix_cache(self) -> bool:
        r = self.llm.reset_prefix_cache()
        return True if r is None else bool(r)

    def prefix_counters(self) -> None:
        return None  # the scheduler's counters live in the engine-core process

    def close(self, timeout: float = 30.0) -> None:
        """Stops the engine-core process (bounded: a hang here must not hold the GPU machine)."""
        import threading

        def stop():
            try:
                fn = getattr(self.llm, "shutdown", None)
                if fn is None:
                    fn = self.llm.llm_engine.engine_core.shutdown
                fn()
            except Exception as e:  # noqa: BLE001
                log(f"vLLM shutdown: {e!r}")

        if self._closed:
            return
        self._closed = True
        t = threading.Thread(target=stop, daemon=True)
        t.start()
        t.join(timeout)

    def info(self) -> dict:
        out = {"llm_init_s": self.startup_s, "llm_kwargs": self.kwargs, "stream_error": self.stream_error}
        try:
            vc = self.llm.llm_engine.vllm_config
            bs = vc.cache_config.block_size
            blocks = vc.cache_config.num_gpu_blocks
            out["engine_config"] = {
                "num_gpu_blocks(frontend view)": blocks, "block_size": bs,
                "kv_capacity_tokens": blocks * bs if blocks and bs else None,
                "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
                "max_num_seqs": vc.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                "async_scheduling": getattr(vc.scheduler_config, "async_scheduling", None),
                "cudagraph_mode": str(getattr(vc.compilation_config, "cudagraph_mode", None)),
                "compilation_mode": str(getattr(vc.compilation_config, "mode", None)),
                "enforce_eager": vc.model_config.enforce_eager, "dtype": str(vc.model_config.dtype),
                "max_model_len": vc.model_config.max_model_len,
            }
        except Exception as e:  # noqa: BLE001
            out["engine_config"] = repr(e)
        try:
            import torch
            out["torch"] = torch.__version__
            import transformers
            out["transformers"] = transformers.__version__
        except ImportError:
            pass
        return out


_LIVE: list[VllmAdapter] = []


def llm_kwargs(model_dir: str, max_model_len: int, gpu_memory_utilization: float, enforce_eager: bool,
               enable_prefix_caching: bool, seed: int, extra: dict | None = None) -> dict:
    # a tokenizer only where the directory carries one: vLLM's beam_search needs it
    skip_tokenizer = not (os.path.isdir(model_dir) and model_dirs.has_tokenizer(model_dir))
    kw = {"model": model_dir, "load_format": "dummy", "skip_tokenizer_init": skip_tokenizer, "max_model_len": max_model_len,
          "gpu_memory_utilization": gpu_memory_utilization, "seed": seed, "enforce_eager": enforce_eager,
          "enable_prefix_caching": enable_prefix_caching}
    for k, v in (extra or {}).items():
        if k in ("max_num_seqs", "max_num_batched_tokens", "dtype", "quantization", "kv_cache_dtype",
                 "moe_backend", "kv_offloading_size", "kv_cache_memory_bytes", "enable_lora", "max_loras",
                 "max_lora_rank", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                 "distributed_executor_backend") and v is not None:
            kw[k] = v
    if kw.get("kv_offloading_size"):
        # vLLM 0.20.0's OffloadingConnector refuses the hybrid KV cache manager (its engine does
        # not start: "does not support HMA but HMA is enabled"; W12, 2026-11-26)
        kw["disable_hybrid_kv_cache_manager"] = True
    return kw


def _metrics_ttft(o) -> float | None:
    m = getattr(o, "metrics", None)
    v = getattr(m, "first_token_latency", None) if m is not None else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


# ---- sub-commands ----------------------------------------------------------------------------------------
def _factory(args):
    if (getattr(args, "data_parallel_size", None) or 1) > 1:
        raise SystemExit("vllm_runner: data_parallel_size > 1 is measured through `vllm serve` (scripts/gpu_w3.sh), "
                         "not the offline LLM (one replica per process in vLLM)")

    def make(model_dir: str, wl: workloads.Workload) -> VllmAdapter:
        a = VllmAdapter(model_dir, max_model_len=args.max_model_len or wl.max_model_len,
                        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        moe_backend=args.moe_backend, **quant_engine_kwargs(args), **lora_engine_kwargs(args))
        _LIVE.append(a)
        return a
    return make


def _settings(args) -> dict:
    return llm_kwargs("<temp dir holding the bundled config.json>", args.max_model_len, args.gpu_memory_utilization,
                      args.enforce_eager, args.enable_prefix_caching, args.seed,
                      {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                       "moe_backend": args.moe_backend, **quant_engine_kwargs(args), **lora_engine_kwargs(args)})


def _dry_run(args, kind: str) -> int:
    wls, _ = drive.load_workloads(args)
    emit_all([envelope(wl.name, "vllm", None, model_dirs.config_name(wl.model_config), "dry-run", _settings(args),
                       wl.summary(), {}, {"dry_run": kind}) for wl in wls], args.output)
    return 0


def cmd_throughput(args) -> int:
    if args.dry_run:
        return _dry_run(args, "throughput")
    return drive.throughput(args, "vllm", _factory(args), _settings(args))


def cmd_latency(args) -> int:
    if args.dry_run:
        return _dry_run(args, "latency")
    return drive.latency(args, "vllm", _factory(args), _settings(args))


def cmd_startup(args) -> int:
    from minivllm.bench.startup import cmd_startup as run
    return run(args, "vllm")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.peers.vllm_runner",
                                description="BENCHMARKS.md workloads on vLLM (peer).")
    sub = p.add_subparsers(dest="command", required=True)
    for name, choices, default, func in (("throughput", ["W1", "W1-8B", "W4", "W10", "W12"], "W1", cmd_throughput),
                                         ("latency", ["W2", "W10-decode"], "W2", cmd_latency)):
        s = sub.add_parser(name)
        add_workload_args(s, choices, default)
        add_common_engine_args(s)
        if name == "throughput":
            add_api_args(s)
        s.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
        s.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
        s.add_argument("--moe-backend", default=None,
                       help="vLLM's MoE kernel (W10: 'triton'; its default FlashInfer CUTLASS choice did not "
                            "finish starting in 9 minutes on the GPU machine's image)")
        s.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="W12: vLLM's explicit KV budget")
        s.add_argument("--dry-run", action="store_true", help="print the plan; needs no vLLM")
        if name == "latency":
            s.add_argument("--reps", type=int, default=5)
            s.add_argument("--no-bandwidth", action="store_true")
        s.set_defaults(func=func)
    from minivllm.bench.startup import add_startup_args
    s = sub.add_parser("startup", help="W6: launch to first token of a fresh vLLM process")
    add_startup_args(s, with_device=False)
    s.set_defaults(func=cmd_startup)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    finally:
        sys.stdout.flush()
        for a in _LIVE:
            a.close()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(rc)  # vLLM's teardown at interpreter exit can hang; the result is printed, the core stopped


if __name__ == "__main__":
    main()
