"""The sub-command bodies shared by minivllm's runner and the vLLM runner: load the workloads,
start one engine, measure W6 in passing, run the procedures, print the JSON envelopes. Each
engine module supplies only an adapter factory and its settings."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from minivllm.bench import api_variants, model_dirs, workloads
from minivllm.bench.common import (copy_bandwidth_in_subprocess, device_name, emit_all, envelope, log,
                                   quant_dir_config)
from minivllm.bench.observe import observe_run
from minivllm.bench.procedures import first_token_probe, run_latency, run_throughput

AdapterFactory = Callable[[str, workloads.Workload], object]  # (model_dir, first workload) -> adapter


def load_workloads(args) -> tuple[list[workloads.Workload], dict]:
    """args.workload is a list of names; they run on one engine, so they must share a model."""
    wls = [workloads.get(n, args.model_config).scaled(args.num_requests, args.max_output, args.max_prompt)
           for n in args.workload]
    models = {wl.model_config for wl in wls}
    if len(models) != 1:
        raise ValueError(f"workloads {args.workload} use different models ({sorted(models)}): run them separately "
                         "or pass one --model-config")
    cfg = model_dirs.load_config(wls[0].model_config)
    return [wl.fit_vocab(cfg["vocab_size"]) for wl in wls], cfg


def _engine(adapter):
    """minivllm's LLMEngine (None for a peer's adapter)."""
    return getattr(adapter, "engine_obj", None)


def _uses_cuda(device: str) -> bool:
    if device != "auto":
        return device.startswith("cuda")
    import torch
    return torch.cuda.is_available()


def _with_quant(settings: dict, args) -> dict:
    """Records the quantization_config written into the model directory (W11), if any."""
    qc = quant_dir_config(args)
    return settings if qc is None else dict(settings, model_quantization_config=qc)


def _variant(args) -> str:
    base = "prefix caching on" if args.enable_prefix_caching else "prefix caching off"
    extra = api_variants.variant_name(args)
    return f"{base}, {extra}" if extra else base


def throughput(args: argparse.Namespace, engine: str, make_adapter: AdapterFactory, settings: dict,
               device: str = "auto") -> int:
    wls, cfg = load_workloads(args)
    wls = [api_variants.workload(wl, args) for wl in wls]  # beam search: one max_tokens for all
    settings = _with_quant(dict(settings, max_model_len=settings.get("max_model_len") or wls[0].max_model_len), args)
    model_dir = model_dirs.write_model_dir(wls[0].model_config, quantization_config=quant_dir_config(args))
    if getattr(args, "beam_width", 0):  # vLLM's beam_search needs a tokenizer: both engines get the same one
        cfg = dict(cfg, vocab_size=model_dirs.add_bundled_tokenizer(model_dir))
        settings = dict(settings, skip_tokenizer_init=False, tokenizer="bundled SmolLM2 (vocab_size 49,152)")
    log(f"{engine} {'+'.join(w.name for w in wls)} on {model_dirs.config_name(wls[0].model_config)}: {settings}")
    adapter = make_adapter(model_dir, wls[0])
    api_variants.attach(adapter, args, model_dir)  # LoRA adapters, beam width (issue 23's variants)
    log(f"{engine} {adapter.version} ready in {adapter.startup_s:.1f} s")
    probe = first_token_probe(adapter, cfg["vocab_size"])
    results, ok = [], True
    for wl in wls:
        with observe_run(args, _engine(adapter), f"{wl.name} on {model_dirs.config_name(wl.model_config)}",
                         _uses_cuda(device)):
            res = run_throughput(adapter, wl, args.repeats)
        figures = dict(res["figures"], startup_s=adapter.startup_s,
                       launch_to_first_token_s=probe["launch_to_first_token_s"])
        ok = ok and figures["output_tokens_ok"]
        results.append(envelope(wl.name, engine, adapter.version, model_dirs.config_name(wl.model_config),
                                device_name(device), dict(settings, repeats=args.repeats, variant=_variant(args)),
                                wl.summary(), figures,
                                {"runs": res["runs"], "first_token_probe": probe, "engine": adapter.info(),
                                 "workloads_in_this_process": [w.name for w in wls]}))
    emit_all(results, args.output)
    return 0 if ok else 1


def latency(args: argparse.Namespace, engine: str, make_adapter: AdapterFactory, settings: dict,
            device: str = "auto", on_gpu: bool = True, dtype_bytes: int = 2) -> int:
    """W2. The copy-bandwidth probe runs in a child process after the engine is closed (so it
    neither delays the first token, which is W6, nor competes for memory)."""
    wls, cfg = load_workloads(args)
    if len(wls) != 1:
        raise ValueError("latency runs one workload (W2 or W10-decode)")
    (wl,) = wls
    settings = _with_quant(dict(settings, max_model_len=settings.get("max_model_len") or wl.max_model_len), args)
    model_dir = model_dirs.write_model_dir(wl.model_config, quantization_config=quant_dir_config(args))
    adapter = make_adapter(model_dir, wl)
    log(f"{engine} {adapter.version} ready in {adapter.startup_s:.1f} s")
    probe = first_token_probe(adapter, cfg["vocab_size"])
    with observe_run(args, _engine(adapter), f"{wl.name} on {model_dirs.config_name(wl.model_config)}", on_gpu):
        res = run_latency(adapter, wl, args.reps)
    info = adapter.info()
    extra = adapter.extra_details() if hasattr(adapter, "extra_details") else {}
    adapter.close()
    bandwidth = None
    if on_gpu and not args.no_bandwidth:
        try:
            bandwidth = copy_bandwidth_in_subprocess()
            log(f"copy bandwidth {bandwidth['bandwidth_TBps']:.2f} TB/s (read + write)")
        except Exception as e:  # noqa: BLE001  (the latency figures stand without it)
            log(f"WARNING: copy bandwidth probe failed: {e}")
    if bandwidth is not None:
        res = add_roofline(res, cfg, wl, bandwidth, dtype_bytes, args)
    figures = dict(res["figures"], startup_s=adapter.startup_s, launch_to_first_token_s=probe["launch_to_first_token_s"])
    result = envelope(wl.name, engine, adapter.version, model_dirs.config_name(wl.model_config), device_name(device),
                      dict(settings, reps=args.reps), wl.summary(), figures,
                      dict(res["details"], first_token_probe=probe, engine=info, **extra))
    emit_all([result], args.output)
    return 0 if figures["output_tokens_ok"] else 1


def add_roofline(res: dict, cfg: dict, wl: workloads.Workload, bandwidth: dict, dtype_bytes: int,
                 args: argparse.Namespace | None = None) -> dict:
    """W2's figures against the weight-read roofline; with --quantization (W11) the linears count at
    their quantized size (int4 + group scales and zeros, or FP8), with an FP8 cache the KV at 1 byte."""
    figures, details = dict(res["figures"]), dict(res["details"])
    n = wl.params[0]["max_tokens"]
    scheme = getattr(args, "quantization", None)
    linear = model_dirs.quantized_linear_bytes(scheme, getattr(args, "quant_group_size", 128), dtype_bytes) \
        if scheme else None
    kv_bytes = 1 if getattr(args, "kv_cache_dtype", "auto") == "fp8" else None
    roof = model_dirs.decode_roofline(cfg, len(wl.prompts[0]), n, bandwidth["bandwidth_Bps"], dtype_bytes, linear,
                                      kv_bytes)
    figures.update(copy_bandwidth_TBps=bandwidth["bandwidth_Bps"] / 1e12, roofline_ms=roof["roofline_ms"],
                   roofline_share=roof["roofline_ms"] / figures["ms_per_token"],
                   roofline_share_all_weights=roof["roofline_ms_all_weights"] / figures["ms_per_token"],
                   weight_bytes_read_per_token=roof["weight_bytes_read_per_step"])
    details.update(roofline=roof, copy_bandwidth=bandwidth,
                   roofline_note="roofline_share counts the weights one decode step reads (all but the embedding "
                                 "table; for a MoE model each layer's attention, norms and router, its top-k "
                                 "experts, the final norm and the LM head: model_dirs.weight_bytes); "
                                 "roofline_share_all_weights counts every parameter, as BENCHMARKS.md's vLLM "
                                 "reference (5.32 ms for Llama-3.1-8B) did; KV bytes = the mean decode context")
    log(f"{wl.name} roofline share {figures['roofline_share']:.1%} ({figures['roofline_share_all_weights']:.1%} all weights)")
    return {"figures": figures, "details": details}
