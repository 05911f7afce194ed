"""The split-K fix-up shared by the GEMV/GEMM kernels that cut K (kernels/w4a16_gemm.py,
dense_gemv.py, invariant_gemm.py) or sum several experts' outputs (fused_moe.py's one-token down
kernel), inside the kernel: no torch sum or cast after it; with the host side they share (how many
slices to cut K into, the workspace and counters of a launch).

With SPLIT_K > 1 every program stores its float32 partial tile to a workspace [SPLIT_K, M, N] (torch.empty per call: free inside
a CUDA graph's pool) and adds 1 to its output tile's int32 counter (tl.atomic_add, acq_rel). The
program that reads back SPLIT_K - 1 is the last of its tile: it adds the SPLIT_K partials in the
fixed order 0..SPLIT_K-1 (deterministic bits whatever order the programs finished in), writes the
tile in x's dtype and sets the counter back to 0. So a split-K product is one launch (no torch
sum + cast after it) and needs no host work or memset per call: the counters (`tile_counters`,
one zeroed buffer per device, cached) are 0 again when each kernel ends, which keeps them valid
across CUDA graph replays. The buffer only grows outside graph capture; the engine's capture
(runner/cuda_graph.py) runs every shape eagerly first, so it is already large enough there.
Kernels on two streams of one device at once would share the counters: the engine runs its
forward on one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_tile(acc, out_ptr, ws_ptr, cnt_ptr, o_off, ws_off, stride_ws, mask, pid_k, tile,
               SPLIT_K: tl.constexpr):
    """The program's float32 tile `acc` -> the output. SPLIT_K 1: stored in out's dtype. Else the
    split-K fix-up: the partial goes to ws[pid_k] and the last program of the tile (by its
    counter cnt[tile]) adds ws[0..SPLIT_K-1] in that order, stores the sum, resets the counter."""
    if SPLIT_K == 1:
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * stride_ws + ws_off, acc, mask=mask)
        # Visibility of the partials to the last program: the partial is stored by all of the
        # program's threads, but Triton issues a scalar atomic from one thread, with no barrier
        # before it. The CTA barrier orders every thread's store before that atomic, whose
        # release (acq_rel, the default sem; gpu scope) publishes them with the increment; the
        # last program's acquire on the same counter makes all SPLIT_K partials visible to its
        # loads below (its threads get the atomic's result after a barrier; .cg reads from L2).
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1)  # programs of this tile finished before this one
        if done == SPLIT_K - 1:
            total = tl.load(ws_ptr + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
            for i in tl.static_range(1, SPLIT_K):  # fixed order: the same bits on every run
                total += tl.load(ws_ptr + i * stride_ws + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + o_off, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile, 0)  # every program of the tile has counted: reusable (graph replays too)


# device -> int32 tile counters, the last (largest) in use; grown buffers stay alive because a
# captured CUDA graph may still point at an older one
COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 4096  # the first buffer's size (16 KiB): Llama-3.1-8B's largest split grid needs ~900


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on `device`, all 0 between kernels (each split-K kernel leaves
    them so). Allocated once per device and grown (to a power of two) only outside CUDA graph
    capture: a zeroing captured into a graph would run on every replay, and the engine's capture
    warms up every shape eagerly first, so the buffer is already big enough there."""
    bufs = COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K needs {n} tile counters during CUDA graph capture, "
                               f"{bufs[-1].numel() if bufs else 0} exist: run the shape once before capturing")
        bufs.append(torch.zeros(max(MIN_COUNTERS, triton.next_power_of_2(n)), dtype=torch.int32, device=device))
    return bufs[-1]


def split_count(tiles: int, k_steps: int, num_sms: int, programs_per_sm: int, max_split: int) -> int:
    """Cut K until a grid of `tiles` output tiles has about programs_per_sm programs per SM: a
    power of two, at most max_split and the number of K steps."""
    want = triton.cdiv(programs_per_sm * num_sms, tiles)
    split = min(triton.next_power_of_2(max(1, want)), max_split, k_steps)
    return 1 << (max(1, split).bit_length() - 1)  # round down to a power of two


def split_buffers(split: int, rows: int, cols: int, tiles: int, out: torch.Tensor):
    """(workspace, counters) of a launch that cuts K into `split` slices over a grid of `tiles`
    output tiles of an out [rows, cols]: float32 [split, rows, cols] and tile_counters; with one
    slice the kernel stores out directly and reads neither (out stands in for both)."""
    if split == 1:
        return out, out
    return (torch.empty(split, rows, cols, dtype=torch.float32, device=out.device),
            tile_counters(out.device, tiles))
