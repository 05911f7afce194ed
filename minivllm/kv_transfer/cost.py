"""The swap-or-recompute cost model (preemption_mode unset): seconds to recompute a token and to
copy a block one way, from the model's size and the device's rough throughput. Estimates, not
measurements: they only need the right order of magnitude (a copy over PCIe costs far less
than recomputing a long prefix; for a few tokens recomputing is cheaper than two copies)."""

from __future__ import annotations

from minivllm.core.swap_space import SwapCosts

# effective prefill FLOP/s and device <-> host bytes/s
_GPU_FLOPS, _GPU_COPY_BPS = 4e14, 2.5e10  # an H100 at ~half its dense bf16 peak; PCIe 5 x16 pinned
_CPU_FLOPS, _CPU_COPY_BPS = 1e11, 5e9  # a few cores of fp32 FMA; memcpy


def estimate_swap_costs(num_params: int, block_bytes: int, on_gpu: bool) -> SwapCosts:
    flops, bps = (_GPU_FLOPS, _GPU_COPY_BPS) if on_gpu else (_CPU_FLOPS, _CPU_COPY_BPS)
    return SwapCosts(recompute_s_per_token=2.0 * num_params / flops, copy_s_per_block=block_bytes / bps)
