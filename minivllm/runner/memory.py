"""How many KV blocks fit: an explicit budget on the CPU, a profiled budget on the GPU.

GPU: KV bytes = total memory x gpu_memory_utilization - (weights + peak activations of one
forward pass at the largest token budget + memory held outside torch) - CUDA graph reserve.

The CUDA graphs keep their own memory pool, never returned to the eager allocator: the
activations of the largest captured forward (mixed-step graphs go up to the step budget), plus
a fixed part for the graphs' static buffers and the decode workspace. The reserve is the
profiled forward's peak (an upper bound when the budget is above the largest graph) plus that
part; the runner logs what the graphs really hold after capture.
"""

from __future__ import annotations

import logging

import torch

from minivllm.config import check
from minivllm.runner.kv_cache import CPU_DEFAULT_KV_BYTES, allocate_kv_cache, format_bytes
from minivllm.runner.profile import blocks_for_dummy_step

logger = logging.getLogger(__name__)

# static graph inputs/outputs and the decode workspace, on top of the graphs' activations
CUDA_GRAPH_STATIC_BYTES = 512 << 20


def plan_num_blocks(runner, per_block: int) -> int:
    cache = runner.config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None or runner.device.type != "cuda":
        budget = cache.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
        if runner.device.type == "cpu":
            # a CPU KV cache is host memory, allocated (and touched) here: one larger than the
            # memory available would get the engine core killed by the out-of-memory killer with
            # no word, where this names the field
            check_fits_host_memory(budget, "kv_cache_memory_bytes")
        num = int(budget // per_block)
        logger.info("KV budget %s (explicit) -> %d blocks", format_bytes(budget), num)
    else:
        num = _profile_gpu_blocks(runner, per_block)
    if num < 1:
        raise ValueError(f"the KV cache budget holds no block of {per_block} bytes: raise "
                         "gpu_memory_utilization or kv_cache_memory_bytes")
    return num


def check_fits_host_memory(nbytes: int, field_name: str) -> None:
    """ValueError naming field_name unless nbytes of host memory are available now (host KV
    pools are allocated at startup: the CPU's KV cache, swap space, the offload tier)."""
    import psutil
    available = psutil.virtual_memory().available
    check(nbytes <= available, field_name,
          f"({format_bytes(nbytes)}) must fit in the host memory available now ({format_bytes(available)})")


def _profile_gpu_blocks(runner, per_block: int) -> int:
    sched = runner.config.scheduler
    num_tokens, num_seqs = sched.max_num_batched_tokens, sched.max_num_seqs
    tmp_blocks = blocks_for_dummy_step(num_tokens, num_seqs, runner.block_size)
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    outside_torch = total - free0 - torch.cuda.memory_reserved()
    if runner.config.cache.kv_budget_own_process:  # one of several engines: the others' memory is theirs
        outside_torch = max(0, outside_torch - runner.others_bytes_at_start)
    weights = torch.cuda.memory_allocated()
    # a temporary cache just big enough for the profiling step
    tmp = allocate_kv_cache(runner.model, tmp_blocks, runner.block_size, runner.kv_dtype, runner.device)
    tmp_bytes = tmp_blocks * per_block
    for layer, (k, v) in zip(runner.model.layers, tmp):
        layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
    torch.cuda.reset_peak_memory_stats()
    forward_peak = runner.dummy_forward(num_tokens, num_seqs) - tmp_bytes
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - tmp_bytes
    del tmp
    for layer in runner.model.layers:
        layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
    torch.cuda.empty_cache()
    activations = peak - weights
    graphs = not runner.config.enforce_eager
    graph_reserve = forward_peak - weights + CUDA_GRAPH_STATIC_BYTES if graphs else 0
    budget = total * runner.config.cache.gpu_memory_utilization
    kv_bytes = budget - peak - outside_torch - graph_reserve
    num = int(kv_bytes // per_block)
    runner.memory_report = {
        "total": total, "utilization": runner.config.cache.gpu_memory_utilization,
        "weights": weights, "peak_activations": activations, "outside_torch": outside_torch,
        "cuda_graph_reserve": graph_reserve, "kv_cache": num * per_block,
        "kv_tokens": num * runner.block_size, "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
    }
    logger.info(
        "memory: total %s x %.2f = %s; weights %s, peak activations %s (%d tokens), outside torch %s, "
        "graph reserve %s -> KV cache %s = %d blocks = %d tokens",
        format_bytes(total), runner.config.cache.gpu_memory_utilization, format_bytes(budget),
        format_bytes(weights), format_bytes(activations), num_tokens, format_bytes(outside_torch),
        format_bytes(graph_reserve), format_bytes(num * per_block), num, num * runner.block_size)
    return num
