"""Turns the user's keyword arguments (LLM(...), CLI flags) into a validated EngineConfig."""

from __future__ import annotations

from minivllm.config import (
    _DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    check,
)
from minivllm.lora.config import LoRAConfig
from minivllm.models.arch import ArchConfig
from minivllm.pooling_params import PoolerConfig
from minivllm.models.source import ModelSource, read_hf_config, resolve_model_source
from minivllm.quant.config import QuantConfig, resolve_quant_config

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# prompt tokens per step beside decoding requests, `minivllm serve` on a GPU (see
# SchedulerLimits.max_prefill_tokens_with_decodes): W3's longest prompt fits in one step
DEFAULT_SERVING_PREFILL_CAP = 1024


def _resolve_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check(device in ("cpu", "cuda") or device.startswith("cuda:"), "device", f"must be auto, cpu or cuda, got {device!r}")
    if device.startswith("cuda"):
        check(torch.cuda.is_available(), "device", "is cuda but no CUDA GPU is available")
    return device


def _resolve_dtype(dtype: str, device: str, arch: ArchConfig) -> str:
    check(dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    return arch.torch_dtype if arch.torch_dtype in ("float16", "bfloat16") else "bfloat16"


def load_arch(source: ModelSource) -> ArchConfig:
    if source.kind == "hf":
        return ArchConfig.from_hf_dict(read_hf_config(source.path))
    from minivllm.models.gguf_loader import gguf_arch_config, open_gguf
    return gguf_arch_config(open_gguf(source.path))


def resolve_quantization(source: ModelSource, quantization: str | None, device: str) -> QuantConfig | None:
    hf_qc = read_hf_config(source.path).get("quantization_config") if source.kind == "hf" else None
    quant = resolve_quant_config(hf_qc, quantization, source.name)
    if quant is not None and quant.scheme == "fp8" and device.startswith("cuda"):
        import torch
        cap = torch.cuda.get_device_capability(torch.device(device))
        check(cap >= (8, 9), "quantization",
              f"{quant.method!r} (FP8 weights) of model {source.name!r} needs a GPU with FP8 (compute capability "
              f">= 8.9); {torch.cuda.get_device_name(torch.device(device))} is {cap[0]}.{cap[1]}")
    return quant


def _resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    check(kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
          f"must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return "fp8" if kv_cache_dtype.startswith("fp8") else "auto"


def build_engine_config(
    model: str | None = None,
    *,
    tokenizer: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory_bytes: int | None = None,
    num_kv_blocks: int | None = None,
    prefix_caching_hash_algo: str = "sha256",
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    scheduling_policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    tensor_parallel_size: int = 1,
    enforce_eager: bool = False,
    attention_backend: str | None = None,
    skip_tokenizer_init: bool = False,
    chat_template: str | None = None,
    served_model_name: str | None = None,
    async_scheduling: bool | None = None,
    max_prefill_tokens_with_decodes: int | None = None,
    speculative_config: dict | str | None = None,
    structured_outputs_config: StructuredOutputsConfig | dict | None = None,
    reasoning_parser: str | None = None,
    serving: bool = False,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    calculate_kv_scales: bool = False,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    pooler_config=None,
    batch_invariant: bool = False,
) -> EngineConfig:
    check(load_format in ("auto", "dummy"), "load_format", f"must be 'auto' or 'dummy', got {load_format!r}")
    source = resolve_model_source(model)
    arch = load_arch(source)
    device = _resolve_device(device)
    on_gpu = device.startswith("cuda")
    dtype = _resolve_dtype(dtype, device, arch)
    quant = resolve_quantization(source, quantization, device)
    kv_cache_dtype = _resolve_kv_cache_dtype(kv_cache_dtype)
    if max_model_len is None:
        max_model_len = min(arch.max_position_embeddings, 8192 if not on_gpu else arch.max_position_embeddings)
    check(isinstance(max_model_len, int) and max_model_len >= 1, "max_model_len", f"must be >= 1, got {max_model_len}")
    check(max_model_len <= arch.max_position_embeddings, "max_model_len",
          f"must be <= the model's max_position_embeddings={arch.max_position_embeddings}, got {max_model_len}")
    check(block_size in (8, 16, 32, 64, 128), "block_size", f"must be one of 8, 16, 32, 64, 128, got {block_size}")
    check(0.0 < gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
          f"must be in (0, 1], got {gpu_memory_utilization}")
    if num_kv_blocks is not None:
        check(num_kv_blocks >= 1, "num_kv_blocks", f"must be >= 1, got {num_kv_blocks}")
    # GPU defaults as vLLM's: 256 sequences / 16,384 tokens a step offline; the server admits up
    # to 1,024 sequences with 8,192-token steps (W3: queueing dominated TTFT at 256)
    max_num_seqs = max_num_seqs or ((1024 if serving else 256) if on_gpu else 64)
    check(max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {max_num_seqs}")
    max_num_batched_tokens = max_num_batched_tokens or ((8192 if serving else 16384) if on_gpu else 2048)
    check(max_num_batched_tokens >= 1, "max_num_batched_tokens", f"must be >= 1, got {max_num_batched_tokens}")
    if not enable_chunked_prefill:
        check(max_num_batched_tokens >= max_model_len, "max_num_batched_tokens",
              f"must be >= max_model_len={max_model_len} when chunked prefill is off, got {max_num_batched_tokens}")
    # the server on a GPU caps prompt tokens beside decoding requests (inter-token latency: a
    # ~1,100-token step of Qwen3-8B takes ~29 ms on an H200, an 8,192-token one ~150 ms); 0: off
    if max_prefill_tokens_with_decodes is None:
        max_prefill_tokens_with_decodes = DEFAULT_SERVING_PREFILL_CAP if serving and on_gpu else 0
    check(max_prefill_tokens_with_decodes >= 0, "max_prefill_tokens_with_decodes",
          f"must be >= 0 (0: no cap), got {max_prefill_tokens_with_decodes}")
    check(scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
          f"must be 'fcfs' or 'priority', got {scheduling_policy!r}")
    check(tensor_parallel_size == 1, "tensor_parallel_size", f"must be 1 (tensor parallelism is not built yet), got {tensor_parallel_size}")
    attention_backend = attention_backend or ("triton" if on_gpu else "torch")
    model_cfg = ModelConfig(
        model=model, source_kind=source.kind, source_path=source.path,
        served_name=served_model_name or source.name, arch=arch, dtype=dtype, load_format=load_format,
        max_model_len=max_model_len, tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init,
        chat_template=chat_template, seed=seed, quantization=quant)
    from minivllm.core.block_hash import block_hash_fn
    block_hash_fn(prefix_caching_hash_algo)  # validates the name (and that xxhash is installed)
    cache = CacheConfig(block_size, enable_prefix_caching, gpu_memory_utilization, kv_cache_memory_bytes, num_kv_blocks,
                        kv_cache_dtype, calculate_kv_scales and kv_cache_dtype == "fp8",
                        prefix_caching_hash_algo=prefix_caching_hash_algo)
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy, enable_chunked_prefill,
                            max_prefill_tokens_with_decodes or None)
    from minivllm.spec_decode.config import parse_speculative_config
    speculative = parse_speculative_config(speculative_config, arch.num_layers)
    # speculative steps need the previous step's accepted tokens before they are scheduled
    check(not (speculative and async_scheduling), "async_scheduling",
          "cannot be on with speculative decoding (a step's drafts depend on the previous step's result)")
    async_scheduling = (on_gpu and speculative is None) if async_scheduling is None else async_scheduling
    batch_invariant = _resolve_batch_invariant(batch_invariant, device, dtype, quant is not None, arch.moe is not None,
                                               kv_cache_dtype, speculative is not None)
    return EngineConfig(model_cfg, cache, sched, ParallelConfig(tensor_parallel_size), device,
                        enforce_eager or not on_gpu, attention_backend, async_scheduling, speculative,
                        lora=_lora_config(enable_lora, max_loras, max_lora_rank, max_cpu_loras, speculative, arch,
                                          batch_invariant),
                        pooler=PoolerConfig.parse(pooler_config),
                        structured_outputs=_structured_config(structured_outputs_config, reasoning_parser),
                        batch_invariant=batch_invariant)


def _lora_config(enable: bool, max_loras: int, max_rank: int, max_cpu: int | None,
                 speculative, arch: ArchConfig, batch_invariant: bool) -> LoRAConfig | None:
    if not enable:
        return None
    check(speculative is None, "enable_lora", "cannot be combined with speculative decoding (not supported yet)")
    check(arch.moe is None, "enable_lora", "is not supported for mixture-of-experts models yet")
    check(not batch_invariant, "enable_lora", "cannot be combined with batch_invariant (the LoRA ops are not "
          "batch-invariant)")
    return LoRAConfig(max_loras, max_rank, max_cpu)


def _resolve_batch_invariant(requested: bool, device: str, dtype: str, quantized: bool, moe: bool,
                             kv_cache_dtype: str, speculative: bool) -> bool:
    """batch_invariant, or VLLM_BATCH_INVARIANT=1; an error where the mode cannot hold."""
    from minivllm.models.batch_invariant import batch_invariant_from_env, unsupported_reason
    if not (requested or batch_invariant_from_env()):
        return False
    why = unsupported_reason("cpu" if device == "cpu" else "cuda", dtype, quantized, moe, kv_cache_dtype, speculative)
    check(why is None, "batch_invariant", f"cannot be on with {why}")
    return True


def _structured_config(given: StructuredOutputsConfig | dict | None, reasoning_parser: str | None) -> StructuredOutputsConfig:
    """structured_outputs_config (a dict of its fields, as vLLM takes it) with --reasoning-parser."""
    from dataclasses import fields, replace

    from minivllm.reasoning import REASONING_PARSERS
    from minivllm.structured.backend import available_backends
    if isinstance(given, dict):
        names = {f.name for f in fields(StructuredOutputsConfig)}
        unknown = sorted(set(given) - names)
        check(not unknown, "structured_outputs_config", f"has unknown fields {unknown} (fields: {sorted(names)})")
        given = StructuredOutputsConfig(**given)
    cfg = given or StructuredOutputsConfig()
    if reasoning_parser:
        cfg = replace(cfg, reasoning_parser=reasoning_parser)
    check(cfg.backend in available_backends(), "structured_outputs_config.backend",
          f"must be one of {available_backends()}, got {cfg.backend!r}")
    check(cfg.reasoning_parser is None or cfg.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
          f"must be one of {sorted(REASONING_PARSERS)}, got {cfg.reasoning_parser!r}")
    return cfg

