"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

Why: a batch-1 decode step is a chain of ~12 small kernels a layer (norm, GEMV, rotary, KV store,
attention, GEMV, norm, router, top-k, expert GEMVs). Between two kernels of one stream the GPU
normally drains the first grid, flushes its writes and only then launches the second: about a
microsecond a boundary even inside a CUDA graph, and the next GEMV starts streaming its weights
only after that (issue 21: 3.93 ms a token of which ~0.4 ms is not kernel time).

With PDL a kernel is launched with `launch_pdl=True` and may start while its predecessor still
runs. The contract each such kernel keeps (checked on the PTX, see `enter_after_previous`):
  - before `enter_after_previous(PDL)` it only computes indices and reads data no kernel of the
    step writes (weights, scales: into L2 with `prefetch_l2`, or into registers, as the streaming
    dense GEMV does with its first tile); it stores nothing;
  - `enter_after_previous` first blocks until the previous grid has finished and its writes are
    visible (griddepcontrol.wait), so everything after it sees the same memory as without PDL,
    and, because that grid waited for its own predecessor, all earlier kernels too; then it lets
    the next kernel's programs be scheduled (griddepcontrol.launch_dependents: they in turn wait
    before touching anything this kernel writes).
Results are bit-identical with and without PDL: only when programs start changes
(tests/gpu/test_pdl.py; the contract on the PTX: tests/unit/test_pdl_compile.py). One
documented exception reads a kernel's output before the wait: the MoE down GEMV reads the
expert ids written two launches back (fused_moe._moe_decode_down_kernel says why that is safe).

Measured (H100, docs/perf.md, 2026-11-27 leases 19-21, same lease with MINIVLLM_PDL=0):
W10-decode (Qwen3-30B-A3B shapes, batch 1) 4.10-4.21 -> 3.71-3.82 ms a token, W2 (Llama-3.1-8B)
5.98 -> 5.73, W11-awq 3.89 -> 3.72; W1 (batch up to 256) unchanged.

`pdl_args(tensor)` gives the launch keywords: {"PDL": True, "launch_pdl": True} on a CUDA
device of compute capability 9.0 or newer, {"PDL": False} elsewhere (Triton's interpreter, older
GPUs, MINIVLLM_PDL=0). Read at each launch, so a benchmark can flip it.
"""

from __future__ import annotations

import functools
import os

import torch

from minivllm.kernels.device import cuda_index

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernel launches, pdl_args says no
    triton = tl = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability >= 9.0, and
    MINIVLLM_PDL not "0"."""
    if triton is None or device.type != "cuda" or os.environ.get("MINIVLLM_PDL", "1") == "0":
        return False
    return _capability_major(cuda_index(device)) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_args(tensor: torch.Tensor) -> dict:
    """The launch keywords of a kernel that takes `PDL: tl.constexpr` and runs on tensor's device."""
    if pdl_enabled(tensor.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@_jit
def enter_after_previous(PDL: tl.constexpr):
    """griddepcontrol.wait: the previous kernel of the stream has finished and its writes are
    visible; then griddepcontrol.launch_dependents: the next kernel may be launched once every
    program of this one has passed here (or exited). Every kernel launched with PDL calls it
    before its first read of data another kernel writes and before its first store, on every
    path."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@_jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (a tensor of pointers, every one valid: the caller
    clamps out-of-range lanes) without waiting or keeping registers: a GEMV calls it on
    its first weight tiles before `enter_after_previous`, so that the weights stream from HBM while
    the previous kernel finishes. Callers call it only with PDL (without it nothing runs before
    the wait, so there is nothing to overlap)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64, bitcast=True)],
                              dtype=tl.int32, is_pure=False, pack=1)


@_jit
def prefetch_rows(row_ptrs, k_first, k_last, SPAN: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr):
    """prefetch_l2 of the elements k_first .. k_first + SPAN - 1 (clamped to k_last) of the rows
    at row_ptrs ([R, 1] pointers to each row's element 0; unit stride along K), one address per
    STEP elements (STEP: a 128-byte line's worth, SPAN / STEP a power of two)."""
    if PDL:
        offs = tl.minimum(k_first + tl.arange(0, SPAN // STEP) * STEP, k_last)
        prefetch_l2(row_ptrs + offs[None, :])


def prefetch_span(dtype: torch.dtype, row_bytes: int, row_elements: int | None = None) -> dict:
    """A GEMV's prefetch_rows constexprs for weights of `dtype`: PREFETCH, the elements of each
    row to request (row_bytes' worth, at most the row rounded up to a power of two, at least a
    line), and LINE, the elements of a 128-byte cache line."""
    line = 128 // dtype.itemsize
    span = row_bytes // dtype.itemsize
    if row_elements is not None:
        span = min(span, triton.next_power_of_2(row_elements))
    return {"PREFETCH": max(line, span), "LINE": line}
