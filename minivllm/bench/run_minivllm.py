"""minivllm's own benchmark runners: throughput (W1, W1-8B, W4, W10), latency (W2, W10-decode) and CPU (W5).

    python -m minivllm bench throughput --workload W1
    python -m minivllm bench throughput --workload W4 --no-prefix-caching
    python -m minivllm bench latency --workload W2
    python -m minivllm bench cpu
    python -m minivllm bench throughput --workload W1 --model-config tiny-llama --device cpu \
        --num-requests 4 --max-output 8          # CPU smoke run, seconds

Each prints one JSON object (minivllm.bench.common's envelope). GPU runs use dummy weights
with the real shapes of the bundled configs (speed does not depend on the weight values when
ignore_eos forces the output length).
"""

from __future__ import annotations

import argparse
import contextlib
import time

from minivllm.bench import drive, model_dirs
from minivllm.bench.common import param_bytes, quant_engine_kwargs
from minivllm.bench.procedures import GenResult


class MinivllmAdapter:
    engine = "minivllm"

    def __init__(self, model_dir: str, **engine_kwargs) -> None:
        import minivllm
        from minivllm import LLM
        self.version = minivllm.__version__
        t = time.perf_counter()
        # a tokenizer only where the directory carries one (beam search: model_dirs.add_bundled_tokenizer)
        self.llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=not model_dirs.has_tokenizer(model_dir),
                       **engine_kwargs)
        self.startup_s = time.perf_counter() - t
        self.engine_obj = self.llm.llm_engine

    def prepare(self, params: list[dict]) -> list:
        from minivllm import SamplingParams
        return [SamplingParams(**p) for p in params]

    def generate(self, prompts: list[dict], prepared: list, want_ttft: bool = False) -> list[GenResult]:
        from minivllm import BeamSearchParams, LoRARequest
        from minivllm.bench import api_variants
        if getattr(self, "beam_width", 0):
            params = BeamSearchParams(beam_width=self.beam_width, max_tokens=prepared[0].max_tokens, ignore_eos=True)
            return api_variants.beam_results(self.llm.beam_search(prompts, params), prompts)
        loras = api_variants.lora_list(self, LoRARequest, len(prompts))
        outs = self.llm.generate(prompts, prepared, use_tqdm=False, lora_request=loras)
        res = []
        for o in outs:
            m = o.metrics
            res.append(GenResult(len(o.outputs[0].token_ids), len(o.prompt_token_ids), o.num_cached_tokens,
                                 m.time_to_first_token if m is not None else None))
        return res

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    @contextlib.contextmanager
    def record_steps(self):
        """While inside: one dict per engine step, the engine's host phases (`last_step`:
        schedule, launch, wait = blocked on the device, update, outputs, in seconds) and the
        step's wall time ("wall"), appended to the yielded list (procedures.step_phase_summary)."""
        engine, records = self.engine_obj, []
        inner = engine.step

        def step():
            t = time.perf_counter()
            out = inner()
            records.append(dict(engine.last_step, wall=time.perf_counter() - t))
            return out

        engine.step = step
        try:
            yield records
        finally:
            del engine.step  # the class's method again

    def prefix_counters(self) -> tuple[int, int]:
        s = self.engine_obj.get_stats()
        return s.prefix_cache_queries, s.prefix_cache_hits

    def close(self) -> None:
        """Stops the engine and frees its GPU memory (W2 probes the copy bandwidth afterwards)."""
        self.engine_obj.shutdown()
        self.llm = self.engine_obj = None
        import gc

        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def extra_details(self) -> dict:
        runner = getattr(getattr(self.engine_obj, "executor", None), "runner", None)
        model = getattr(runner, "model", None)
        if model is None:
            return {}
        details = {"model_param_bytes_measured": param_bytes(model)}
        s = self.engine_obj.get_stats()
        if s.num_preemptions or s.kv_transfer_bytes:  # W12
            details["kv_tiers"] = {k: getattr(s, k) for k in (
                "num_preemptions", "num_blocks_swapped_out", "num_blocks_swapped_in", "offload_hit_blocks",
                "offload_stored_blocks", "kv_transfer_bytes", "prefix_cache_queries", "prefix_cache_hits")}
        if s.spec_num_drafts:
            details["spec_decode"] = {"num_drafts": s.spec_num_drafts, "num_draft_tokens": s.spec_num_draft_tokens,
                                      "num_accepted_tokens": s.spec_num_accepted_tokens,
                                      "acceptance_rate": s.spec_num_accepted_tokens / max(s.spec_num_draft_tokens, 1),
                                      "mean_acceptance_length": 1 + s.spec_num_accepted_tokens / s.spec_num_drafts,
                                      "accepted_per_pos": list(s.spec_accepted_per_pos)}
        return details

    def info(self) -> dict:
        eng = self.engine_obj
        cfg = eng.config
        runner = getattr(getattr(eng, "executor", None), "runner", None)
        # data parallelism: every replica's KV blocks (a DataParallelEngine has no block manager)
        num_blocks = sum(e.block_manager.num_blocks for e in getattr(eng, "replicas", [eng]))
        out = {"llm_init_s": self.startup_s, "engine_startup_s": getattr(eng, "startup_s", None),
               "device": cfg.device, "dtype": cfg.model.dtype, "enforce_eager": cfg.enforce_eager,
               "attention_backend": cfg.attention_backend,
               "block_size": cfg.cache.block_size, "enable_prefix_caching": cfg.cache.enable_prefix_caching,
               "max_num_seqs": cfg.scheduler.max_num_seqs,
               "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
               "max_model_len": cfg.scheduler.max_model_len, "num_kv_blocks": num_blocks,
               "kv_capacity_tokens": num_blocks * cfg.cache.block_size}
        if runner is not None:
            out["runner_timings"] = dict(getattr(runner, "timings", {}) or {})
            report = getattr(runner, "memory_report", None)
            if report:
                out["memory_report"] = dict(report)
            graphs = getattr(runner, "graphs", None)
            if graphs is not None:
                out["cuda_graph_batch_sizes"] = len(getattr(graphs, "batch_sizes", []))
        moe = expert_load(eng)
        if moe is not None:
            out["moe_expert_load"] = moe
        return out


def expert_load(engine) -> dict | None:
    """A MoE model's per-expert token counts since startup (every run on this engine), per layer,
    and how uneven they are: max / mean over a layer's experts (1.0 = perfectly even). Counted
    once per token: tensor-parallel ranks' counts are the driver's, replicas' are summed."""
    config = getattr(engine, "config", None)
    if config is not None and config.model.arch.moe is None:  # a dense model: nothing to ask the ranks
        return None
    source = engine if hasattr(engine, "replicas") else getattr(engine, "executor", None)
    read = getattr(source, "expert_token_counts_per_layer", None)
    per_layer = read() if read is not None else None
    if not per_layer:
        return None
    ratios = [max(c) / (sum(c) / len(c)) for c in per_layer if sum(c)]
    return {"tokens_per_expert_per_layer": per_layer,
            "max_over_mean_per_layer": [round(r, 3) for r in ratios],
            "max_over_mean_worst_layer": max(ratios, default=None)}


# ---- engine options ----------------------------------------------------------------------------------
def add_minivllm_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: the config's bf16 on the GPU, fp32 on the CPU")
    p.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="explicit KV budget (CPU default 1 GiB)")
    p.add_argument("--preemption-mode", default=None, choices=["swap", "recompute"], help="W12")
    p.add_argument("--swap-space", type=float, default=None, help="W12: GiB of host memory for swap preemption")


def engine_kwargs(args) -> dict:
    """LLM(...) keyword arguments from the flags; max_model_len None = the workload's (4096)."""
    kw = {"max_model_len": args.max_model_len, "dtype": args.dtype, "device": args.device,
          "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager,
          "enable_prefix_caching": args.enable_prefix_caching, "seed": args.seed, "block_size": args.block_size}
    for k in ("attention_backend", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
              "preemption_mode", "swap_space"):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k)
    from minivllm.bench.api_variants import lora_engine_kwargs
    return dict(kw, **quant_engine_kwargs(args), **lora_engine_kwargs(args))


def _settings(kw: dict) -> dict:
    return dict(kw, load_format="dummy", skip_tokenizer_init=True)


def _factory(kw: dict):
    return lambda model_dir, wl: MinivllmAdapter(model_dir, **dict(kw, max_model_len=kw["max_model_len"]
                                                                    or wl.max_model_len))


def cmd_throughput(args) -> int:
    kw = engine_kwargs(args)
    return drive.throughput(args, "minivllm", _factory(kw), _settings(kw), kw["device"])


def cmd_latency(args) -> int:
    kw = engine_kwargs(args)
    on_gpu = _on_gpu(kw["device"])
    dtype_bytes = 4 if kw["dtype"] == "float32" or (kw["dtype"] == "auto" and not on_gpu) else 2
    return drive.latency(args, "minivllm", _factory(kw), _settings(kw), kw["device"], on_gpu, dtype_bytes)


def _on_gpu(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch
    return torch.cuda.is_available()


def add_parsers(sub) -> None:
    from minivllm.bench.common import add_common_engine_args, add_workload_args
    from minivllm.bench.observe import add_observe_args
    t = sub.add_parser("throughput", help="W1 / W1-8B / W4 offline throughput on dummy weights")
    add_workload_args(t, ["W1", "W1-8B", "W4", "W10", "W12"], "W1")
    add_common_engine_args(t)
    add_minivllm_engine_args(t)
    add_observe_args(t)
    from minivllm.bench.api_variants import add_api_args
    add_api_args(t)
    t.set_defaults(bench_func=cmd_throughput)

    lat = sub.add_parser("latency", help="W2 batch-1 latency: TTFT, decode tok/s, roofline share")
    add_workload_args(lat, ["W2", "W10-decode"], "W2")
    add_common_engine_args(lat)
    add_minivllm_engine_args(lat)
    add_observe_args(lat)
    lat.add_argument("--reps", type=int, default=5, help="timed repetitions of each of T_1 and T_n")
    lat.add_argument("--no-bandwidth", action="store_true", help="skip the copy-bandwidth probe")
    lat.set_defaults(bench_func=cmd_latency)
