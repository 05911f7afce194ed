"""Turns the user's keyword arguments (LLM(...), CLI flags) into a validated EngineConfig."""

from __future__ import annotations

import dataclasses

from minivllm.config import (
    _DTYPES,
    EXECUTOR_BACKENDS,
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
from minivllm.distributed.sharding import padded_vocab_size
from minivllm.models.source import load_arch, resolve_model_source, resolve_quantization
from minivllm.quant.config import QuantConfig
from minivllm.spec_decode.config import SpeculativeConfig

__all__ = ["build_engine_config", "load_arch", "resolve_quantization"]  # the last two: models/source.py

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
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    enable_expert_parallel: bool = False,
    disable_custom_all_reduce: bool = False,
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
    swap_space: float | None = None,
    preemption_mode: str | None = None,
    kv_offloading_size: float | None = None,
    memory_share: float | None = None,
    batch_invariant: bool = False,
    kv_transfer_config: dict | str | None = None,
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
    check(isinstance(gpu_memory_utilization, (int, float)) and not isinstance(gpu_memory_utilization, bool)
          and 0.0 < gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
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
    attention_backend = attention_backend or ("triton" if on_gpu else "torch")
    model_cfg = ModelConfig(
        model=model, source_kind=source.kind, source_path=source.path,
        served_name=served_model_name or source.name, arch=arch, dtype=dtype, load_format=load_format,
        max_model_len=max_model_len, tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init,
        chat_template=chat_template, seed=seed, quantization=quant)
    from minivllm.core.block_hash import block_hash_fn
    block_hash_fn(prefix_caching_hash_algo)  # validates the name (and that xxhash is installed)
    gpu_memory_utilization, kv_cache_memory_bytes, own_process = _apply_memory_share(
        memory_share, on_gpu, gpu_memory_utilization, kv_cache_memory_bytes, num_kv_blocks)
    swap_bytes, offload_bytes = resolve_host_kv(swap_space, preemption_mode, kv_offloading_size, enable_prefix_caching)
    cache = CacheConfig(block_size, enable_prefix_caching, gpu_memory_utilization, kv_cache_memory_bytes, num_kv_blocks,
                        kv_cache_dtype, calculate_kv_scales and kv_cache_dtype == "fp8",
                        prefix_caching_hash_algo=prefix_caching_hash_algo, swap_space_bytes=swap_bytes,
                        preemption_mode=preemption_mode, kv_offloading_bytes=offload_bytes,
                        kv_budget_own_process=own_process)
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy, enable_chunked_prefill,
                            max_prefill_tokens_with_decodes or None)
    from minivllm.spec_decode.config import parse_speculative_config
    speculative = parse_speculative_config(speculative_config, arch.num_layers)
    parallel = resolve_parallel(arch, device, tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
                                distributed_executor_backend, quant, speculative, enable_expert_parallel)
    if parallel.spans_replicas:
        # the replicas step in lock-step, one forward each per step (a step with nothing to run
        # joins the all_to_alls with no tokens), whose splits travel through the host
        check(not async_scheduling, "async_scheduling",
              "cannot be on with enable_expert_parallel and data_parallel_size > 1 (the replicas step in lock-step)")
        async_scheduling = False
        enforce_eager = True
        check(speculative is None, "speculative_config", "is not supported with enable_expert_parallel and "
              "data_parallel_size > 1 (draft forwards would break the replicas' one forward a step)")
    check(parallel.world_size == 1 or not (swap_bytes or offload_bytes), "swap_space / kv_offloading_size",
          f"need one rank (the multi-process executor has no host KV tiers yet), got world size {parallel.world_size}")
    # pipeline stages need each step's tokens on the host (a later stage cannot fill in a token
    # the step before samples): several whole batches are in flight instead
    check(not (async_scheduling and parallel.pipeline_parallel_size > 1), "async_scheduling",
          "cannot be on with pipeline_parallel_size > 1 (the stages keep several batches in flight instead)")
    # with speculative decoding only the steps that speculate run synchronously (their drafts
    # depend on the step before: LLMEngine._speculates); plain steps keep a step in flight
    async_scheduling = ((on_gpu and parallel.pipeline_parallel_size == 1)
                        if async_scheduling is None else async_scheduling)
    # CUDA graphs capture the whole model's forward; a pipeline stage's receives stay eager
    eager = enforce_eager or not on_gpu or parallel.pipeline_parallel_size > 1
    batch_invariant = _resolve_batch_invariant(batch_invariant, device, dtype, quant is not None, arch.moe is not None,
                                               kv_cache_dtype, speculative is not None)
    # the custom all-reduce picks its kernel by message size, so it stays off where a row's bits
    # must not depend on the batch (as vLLM turns its own off under VLLM_BATCH_INVARIANT)
    parallel = dataclasses.replace(parallel, disable_custom_all_reduce=disable_custom_all_reduce or batch_invariant)
    kv_transfer = _kv_transfer_config(kv_transfer_config, device, parallel, speculative)
    # pulled fp8 blocks mean what the producer's scales say: both must have the checkpoint's
    check(kv_transfer is None or not cache.calculate_kv_scales, "calculate_kv_scales",
          "cannot be combined with kv_transfer_config (each instance would scale its fp8 KV differently)")
    return EngineConfig(model_cfg, cache, sched, parallel, device, eager, attention_backend, async_scheduling,
                        speculative,
                        lora=_lora_config(enable_lora, max_loras, max_lora_rank, max_cpu_loras, speculative, arch,
                                          batch_invariant, parallel),
                        pooler=PoolerConfig.parse(pooler_config),
                        structured_outputs=_structured_config(structured_outputs_config, reasoning_parser),
                        batch_invariant=batch_invariant, kv_transfer=kv_transfer)


def _kv_transfer_config(value, device: str, parallel, speculative):
    """kv_transfer_config validated, with the combinations disaggregation does not support refused
    and a random engine_id when none is given."""
    from minivllm.config import parse_kv_transfer_config
    cfg = parse_kv_transfer_config(value)
    if cfg is None:
        return None
    check(parallel.world_size == 1, "kv_transfer_config",
          f"needs one rank per instance (tensor_parallel_size = pipeline_parallel_size = 1), got world size "
          f"{parallel.world_size}")
    check(parallel.data_parallel_size == 1, "kv_transfer_config",
          f"needs data_parallel_size 1 (run one instance per replica behind `minivllm router`), got "
          f"{parallel.data_parallel_size}")
    check(parallel.distributed_executor_backend == "uni", "kv_transfer_config",
          f"needs the in-process executor (distributed_executor_backend 'uni'), got "
          f"{parallel.distributed_executor_backend!r}")
    check(speculative is None, "kv_transfer_config", "cannot be combined with speculative decoding (not supported)")
    check(cfg.kv_connector != "CudaIpcConnector" or device.startswith("cuda"), "kv_transfer_config.kv_connector",
          f"'CudaIpcConnector' needs a CUDA device, got device {device!r}")
    check(cfg.kv_buffer_device == "cpu" or device.startswith("cuda"), "kv_transfer_config.kv_buffer_device",
          f"'cuda' needs a CUDA device, got device {device!r}")
    if cfg.engine_id is None:
        import dataclasses
        import uuid
        cfg = dataclasses.replace(cfg, engine_id=uuid.uuid4().hex)
    return cfg


def _lora_config(enable: bool, max_loras: int, max_rank: int, max_cpu: int | None,
                 speculative, arch: ArchConfig, batch_invariant: bool, parallel) -> LoRAConfig | None:
    if not enable:
        return None
    check(speculative is None, "enable_lora", "cannot be combined with speculative decoding (not supported yet)")
    check(arch.moe is None, "enable_lora", "is not supported for mixture-of-experts models yet")
    check(not batch_invariant, "enable_lora", "cannot be combined with batch_invariant (the LoRA ops are not "
          "batch-invariant)")
    check(parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1, "enable_lora",
          "is not supported with tensor/pipeline parallelism yet")
    return LoRAConfig(max_loras, max_rank, max_cpu)


def _positive_int(value, name: str) -> None:
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, f"must be an integer >= 1, got {value!r}")


def resolve_parallel(arch: ArchConfig, device: str, tp: int, pp: int, dp: int, backend: str | None,
                     quant: QuantConfig | None, speculative: SpeculativeConfig | None,
                     expert_parallel: bool = False) -> ParallelConfig:
    """Validated parallel sizes: tp must split the heads, the KV heads (or be a multiple of them:
    they are then replicated), the MLP and the padded vocabulary evenly; every pipeline stage
    needs a layer; on CUDA every rank of every replica needs its own GPU. A MoE model's experts
    are split by tp (features) or, with expert_parallel, over tp x dp ranks (whole experts)."""
    for value, name in ((tp, "tensor_parallel_size"), (pp, "pipeline_parallel_size"), (dp, "data_parallel_size")):
        _positive_int(value, name)
    world = tp * pp
    backend = backend or ("uni" if world == 1 and dp == 1 else "mp")  # replicas: each its own worker(s)
    check(backend in EXECUTOR_BACKENDS, "distributed_executor_backend", f"must be one of {list(EXECUTOR_BACKENDS)}, got {backend!r}")
    check(backend != "uni" or world == 1, "distributed_executor_backend",
          f"'uni' runs one rank in the engine's process; tensor_parallel_size x pipeline_parallel_size = {world} "
          "needs 'mp' or 'ray'")
    check(arch.num_heads % tp == 0, "tensor_parallel_size",
          f"must divide the model's number of attention heads ({arch.num_heads}), got {tp}")
    kv = arch.num_kv_heads
    check(kv % tp == 0 if tp <= kv else tp % kv == 0, "tensor_parallel_size",
          f"must divide the model's number of KV heads ({kv}) or be a multiple of it, got {tp}")
    check(arch.intermediate_size % tp == 0, "tensor_parallel_size",
          f"must divide the model's intermediate_size ({arch.intermediate_size}), got {tp}")
    padded = padded_vocab_size(arch.vocab_size)
    check(tp == 1 or padded % tp == 0, "tensor_parallel_size",
          f"must divide the vocabulary padded to a multiple of 64 ({arch.vocab_size} -> {padded}), got {tp}")
    check(pp <= arch.num_layers, "pipeline_parallel_size",
          f"must be <= the model's number of layers ({arch.num_layers}), got {pp}")
    if device.startswith("cuda") and backend != "ray":  # Ray places ranks on the cluster's GPUs
        import torch
        have = torch.cuda.device_count()
        check(world * dp <= have, "tensor_parallel_size",
              f"x pipeline_parallel_size x data_parallel_size = {tp} x {pp} x {dp} = {world * dp} ranks, "
              f"more than the {have} GPU(s) of this machine")
    if world > 1:
        check(quant is None, "quantization",
              f"{quant.method if quant else ''!r} is not supported with tensor/pipeline parallelism yet "
              f"(tensor_parallel_size={tp}, pipeline_parallel_size={pp})")
        check(speculative is None, "speculative_config",
              f"is not supported with tensor/pipeline parallelism yet (tensor_parallel_size={tp}, "
              f"pipeline_parallel_size={pp})")
    _check_moe_parallel(arch, tp, pp, dp, backend, expert_parallel)
    return ParallelConfig(tp, pp, dp, backend, enable_expert_parallel=expert_parallel)


def _check_moe_parallel(arch: ArchConfig, tp: int, pp: int, dp: int, backend: str, expert_parallel: bool) -> None:
    """What the MoE layouts of models/moe.py need: tp splitting each expert's (and the shared
    expert's) features, or expert_parallel's ranks dividing the experts; one pipeline stage."""
    moe = arch.moe
    check(moe is not None or not expert_parallel, "enable_expert_parallel",
          f"needs a mixture-of-experts model; {arch.architecture} has no experts")
    if moe is None:
        return
    check(pp == 1, "pipeline_parallel_size", f"must be 1 for a mixture-of-experts model for now, got {pp}")
    check(moe.shared_expert_intermediate_size % tp == 0, "tensor_parallel_size",
          f"must divide the shared expert's intermediate size ({moe.shared_expert_intermediate_size}), got {tp}")
    if not expert_parallel:
        check(moe.intermediate_size % tp == 0, "tensor_parallel_size",
              f"must divide the experts' moe_intermediate_size ({moe.intermediate_size}), got {tp} "
              "(or use enable_expert_parallel)")
        return
    ranks = tp * dp
    check(moe.num_experts % ranks == 0, "enable_expert_parallel",
          f"needs tensor_parallel_size x data_parallel_size = {tp} x {dp} = {ranks} ranks to divide the model's "
          f"{moe.num_experts} experts evenly (whole experts per rank)")
    check(dp == 1 or backend == "mp", "enable_expert_parallel",
          f"with data_parallel_size={dp} needs distributed_executor_backend='mp' (one world over the replicas' "
          f"worker processes), got {backend!r}")


def _resolve_batch_invariant(requested: bool, device: str, dtype: str, quantized: bool, moe: bool,
                             kv_cache_dtype: str, speculative: bool) -> bool:
    """batch_invariant, or VLLM_BATCH_INVARIANT=1; an error where the mode cannot hold."""
    from minivllm.models.batch_invariant import batch_invariant_from_env, unsupported_reason
    if not (requested or batch_invariant_from_env()):
        return False
    why = unsupported_reason("cpu" if device == "cpu" else "cuda", dtype, quantized, moe, kv_cache_dtype, speculative)
    check(why is None, "batch_invariant", f"cannot be on with {why}")
    return True


def _apply_memory_share(share: float | None, on_gpu: bool, utilization: float, kv_bytes: int | None,
                        num_kv_blocks: int | None) -> tuple[float, int | None, bool]:
    """One of several models on a device (server/multi_model.py): its KV memory is `share` of
    the explicit or default budget (CPU, kv_cache_memory_bytes) or of gpu_memory_utilization.
    Returns (gpu_memory_utilization, kv_cache_memory_bytes, whether the budget is this process's own)."""
    if share is None or num_kv_blocks is not None:
        return utilization, kv_bytes, False
    check(isinstance(share, (int, float)) and 0 < share <= 1, "memory_share", f"must be in (0, 1], got {share!r}")
    if kv_bytes is not None or not on_gpu:
        from minivllm.runner.kv_cache import CPU_DEFAULT_KV_BYTES
        return utilization, int(share * (kv_bytes or CPU_DEFAULT_KV_BYTES)), False
    return utilization * share, None, True


def resolve_host_kv(swap_space: float | None, preemption_mode: str | None, kv_offloading_size: float | None,
                    enable_prefix_caching: bool) -> tuple[int, int]:
    """swap_space and kv_offloading_size (GiB, vLLM's) -> bytes, checked against the host memory
    now available (both pools are allocated, pinned on a GPU, at startup)."""
    from minivllm.core.swap_space import PREEMPTION_MODES
    check(preemption_mode is None or preemption_mode in PREEMPTION_MODES, "preemption_mode",
          f"must be one of {list(PREEMPTION_MODES)} or unset, got {preemption_mode!r}")
    for name, gib in (("swap_space", swap_space), ("kv_offloading_size", kv_offloading_size)):
        check(gib is None or (isinstance(gib, (int, float)) and gib >= 0), name, f"must be >= 0 GiB, got {gib!r}")
    if swap_space is None:  # vLLM's default swap space, where swapping was asked for
        swap_space = 4.0 if preemption_mode == "swap" else 0.0
    check(not (preemption_mode == "swap" and swap_space == 0), "swap_space",
          "must be > 0 GiB with preemption_mode='swap'")
    offload = kv_offloading_size or 0.0
    check(offload == 0 or enable_prefix_caching, "kv_offloading_size",
          "needs enable_prefix_caching (the offload tier keeps the prefix cache's evicted blocks)")
    swap_bytes, offload_bytes = int(swap_space * (1 << 30)), int(offload * (1 << 30))
    if swap_bytes + offload_bytes:
        from minivllm.runner.memory import check_fits_host_memory
        check_fits_host_memory(swap_bytes + offload_bytes, "swap_space + kv_offloading_size")
    return swap_bytes, offload_bytes


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

