"""The batch-1 W4A16 GEMV as a stream-K launch (issue 25; opt-in: MINIVLLM_W4A16_GEMV_STREAMK=N
runs every one- or two-row W4A16 product this way with N programs per SM, w4a16_gemm.w4a16_gemm).

Why: the split-K GEMV (w4a16_gemm._w4a16_gemv_kernel) gives each program one output tile's K
slice, a few K steps long. The H200's tile sweep (lease 43) ran Llama-3.1-8B's largest GEMV,
gate_up, at 2.8 TB/s of int4 at best, 67 % of the copy rate, and faster with FEWER, longer
programs (32x512 tiles: 22.4 us unsplit against 26.4 us at two K slices): each program's first
loads, its final reduction and its store are a fixed cost, and the grid ends in a partial wave.

Here the grid is P programs, about as many as the GPU holds at once, and the work is the flat
sequence of (output tile, K step) units, U = tiles x steps, in tile-major order:

    program p streams units [p U / P, (p + 1) U / P)   (one contiguous run, ~U / P units)

so every program keeps loading from its first unit to its last, across tile boundaries (the next
unit's words, scales and zeros are loaded before this unit's math, as the split-K kernel's PIPE
loop does, the first before the PDL wait). At each tile's last unit, or the program's last, the
program reduces its accumulator into the tile's [BLOCK_N] partial. A tile wholly inside one
program's run is stored directly; a tile cut between programs c_first .. c_last (those whose runs
hold its first and last unit) goes through a fix-up like kernels/split_k.py's: each writes its
partial to slot p - c_first of the tile's workspace row and counts on the tile's counter; the one
that reads n_parts - 1 adds the slots in order 0, 1, ... (the same bits on every run for a given
P) and stores the tile. The program of a unit u is ((u + 1) P - 1) // U.

The products are the split-K kernel's (_half2_step / _plain_step on the same K steps); only where
K is cut, and so the float32 sums' grouping, differs. Launch: stream_k_gemv; the tests are
tests/gpu/test_quant_kernels.py (GPU) and tests/unit/test_quant_interpret.py (interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import enter_after_previous, pdl_args
from minivllm.kernels.split_k import tile_counters
from minivllm.kernels.w4a16_gemm import MAGIC, _half2_step, _plain_step, _w4_step_operands

@triton.jit
def _unit_program(u, U, P):
    """The program whose run holds unit u (the inverse of run start p U / P)."""
    return ((u + 1) * P - 1) // U


@triton.jit
def _finish_tile(acc, out_ptr, ws_ptr, cnt_ptr, m, tile, p, rn, n_ok, S, U, P, T, stride_om, stride_on,
                 BLOCK_N: tl.constexpr, MAX_PARTS: tl.constexpr, HALF2: tl.constexpr):
    """This program's share of `tile` (acc [BLOCK_K/8, BLOCK_N]) -> stored, or into the tile's
    fix-up (module docstring; the visibility argument is split_k.store_tile's)."""
    part = tl.sum(acc, 0)  # [BLOCK_N]
    if HALF2:
        part = part * 16.0  # the packed products took the activations divided by 16 (exact)
    o_ptrs = out_ptr + m * stride_om + rn * stride_on
    c_first = _unit_program(tile * S, U, P)
    n_parts = _unit_program(tile * S + S - 1, U, P) - c_first + 1
    if n_parts == 1:
        tl.store(o_ptrs, part.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        row = ws_ptr + (m * T + tile).to(tl.int64) * (MAX_PARTS * BLOCK_N) + tl.arange(0, BLOCK_N)
        tl.store(row + (p - c_first) * BLOCK_N, part)
        tl.debug_barrier()
        counter = cnt_ptr + m * T + tile
        if tl.atomic_add(counter, 1) == n_parts - 1:
            total = tl.load(row, cache_modifier=".cg")
            for i in range(1, n_parts):  # fixed order: the same bits on every run
                total += tl.load(row + i * BLOCK_N, cache_modifier=".cg")
            tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.store(counter, 0)  # every part has counted: 0 again for the next launch (graph replays too)


@triton.jit
def _w4a16_gemv_streamk_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,  # as _w4a16_gemv_kernel
    ws_ptr,  # float32 [M, tiles, MAX_PARTS, BLOCK_N]: the cut tiles' partials
    cnt_ptr,  # int32 counters, M x tiles of them, 0 on entry and on exit (split_k.tile_counters)
    M, N, K,
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_om, stride_on,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MAX_PARTS: tl.constexpr,  # the most programs one tile's units can fall to (stream_k_parts)
    HALF2: tl.constexpr = False, EVEN: tl.constexpr = False, PDL: tl.constexpr = False,
    XPAIR: tl.constexpr = False,
):
    """grid = (P, M): program p of activation row m streams its run of that row's units."""
    p, m = tl.program_id(0), tl.program_id(1)
    P = tl.num_programs(0)
    S = tl.cdiv(K, BLOCK_K)  # K steps a tile
    T = tl.cdiv(N, BLOCK_N)
    U = T * S
    u_begin = p * U // P
    u_end = (p + 1) * U // P
    rw = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    tile, t = u_begin // S, u_begin % S  # this unit's; then advanced by one each iteration (no division)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w, s, z = _w4_step_operands(qw_ptr, s_ptr, z_ptr, rn, rw, rn < N, K, t, S, stride_qk, stride_qn,
                                stride_sg, stride_sn, GROUP, BLOCK_K, EVEN)
    enter_after_previous(PDL)
    for u in range(u_begin, u_end):
        last = u + 1 == u_end
        wrap = t + 1 == S
        # the next unit (the last one reloads itself: an L2 hit, and no unit past the run is read)
        t_nxt = tl.where(last, t, tl.where(wrap, 0, t + 1))
        tile_nxt = tl.where(last | ~wrap, tile, tile + 1)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rn_nxt = tile_nxt * BLOCK_N + tl.arange(0, BLOCK_N)
        w_n, s_n, z_n = _w4_step_operands(qw_ptr, s_ptr, z_ptr, rn_nxt, rw, rn_nxt < N, K, t_nxt, S, stride_qk,
                                          stride_qn, stride_sg, stride_sn, GROUP, BLOCK_K, EVEN)
        words = t * (BLOCK_K // 8) + rw
        if HALF2:
            acc += _half2_step(w, z, x_ptr, m, words, K, stride_xm, stride_xk, BLOCK_N, BLOCK_K, EVEN,
                               XPAIR) * s.to(tl.float32)
        else:
            acc = _plain_step(acc, w, z.to(tl.float32) + MAGIC, s.to(tl.float32), x_ptr, m, words, K, stride_xm,
                              stride_xk)
        if wrap | last:
            _finish_tile(acc, out_ptr, ws_ptr, cnt_ptr, m, tile, p, rn, rn < N, S, U, P, T, stride_om, stride_on,
                         BLOCK_N, MAX_PARTS, HALF2)
            acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        w, s, z = w_n, s_n, z_n
        tile, t = tile_nxt, t_nxt


def stream_k_parts(units: int, steps: int, programs: int) -> int:
    """The most programs whose runs one tile's `steps` consecutive units can touch."""
    shortest = units // programs  # every run has at least this many units
    return min(programs, triton.cdiv(steps, max(1, shortest)) + 1)


def stream_k_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                  out: torch.Tensor, programs: int, cfg: dict) -> torch.Tensor:
    """out [M, N] = the GEMV of x [M, K] (M of one or two rows) as one stream-K launch of
    `programs` programs a row (at most one a unit); cfg: BLOCK_N, BLOCK_K, num_warps, num_stages
    and the GEMV's HALF2, EVEN, XPAIR switches (w4a16_gemm sets them as for the split-K kernel)."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = {key: v for key, v in cfg.items() if key not in ("PIPE", "COL_STEP", "PREFETCH_WORDS")}  # (split-K's)
    tiles, steps = triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(k, cfg["BLOCK_K"])
    programs = max(1, min(programs, tiles * steps))
    parts = triton.next_power_of_2(stream_k_parts(tiles * steps, steps, programs))
    ws = torch.empty(m * tiles * parts * cfg["BLOCK_N"], dtype=torch.float32, device=x.device)
    cnt = tile_counters(x.device, m * tiles)
    _w4a16_gemv_streamk_kernel[(programs, m)](
        x, qweight, scales, zeros, out, ws, cnt, m, n, k, *x.stride(), *qweight.stride(), *scales.stride(),
        *out.stride(), GROUP=group, MAX_PARTS=parts, **cfg, **pdl_args(x))
    return out
