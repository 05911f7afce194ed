"""Fused mixture-of-experts: routing (softmax, top-k) and the experts' SwiGLU MLPs as grouped GEMMs.

Weights, stacked per layer at load time (models/moe.py):
    w13: [E, 2 I, H]  rows 0 .. I the gate projection, I .. 2I the up projection
    w2:  [E, H, I]    the down projection
Routing of T tokens: topk_weights [T, k] fp32, topk_ids [T, k] int32. Entry e = t * k + j is
token t's j-th expert.

    y[t] = sum_j  topk_weights[t, j] * (w2[id] @ (silu(w13[id, :I] @ x[t]) * (w13[id, I:] @ x[t])))

GPU path (Triton), for one layer:
1. `moe_align` (kernels/moe_align.py): entries sorted by expert, each expert's run padded to
   BLOCK_M rows; block b of the sorted rows belongs to one expert.
2. up GEMM: program (b, n) multiplies block b's BLOCK_M token rows by BLOCK_N columns of
   its expert's gate AND the same columns of its up projection, applies silu(gate) * up in fp32
   and stores [BLOCK_M, BLOCK_N] of the intermediate, rows indexed by entry.
3. down GEMM: the same grouping over the intermediate, each row scaled by its routing weight
   (fp32), stored by entry: [T * k, H].
4. the k rows of each token summed: [T, k, H] -> [T, H].
Each selected expert's weights are read once per step whatever the token count (a decode step
of one token reads 8 of 128 experts of Qwen3-30B-A3B, once each). One token (batch-1 decode)
skips 1, 3 and 4: its k experts are distinct, so two GEMV kernels do the up projection and the
down projection with the weighted k-sum folded in: persistent, double-buffered ones
(`_fused_moe_one_token_stream`, where whole rows fit in registers) or a program per tile
(`_fused_moe_one_token`). Every shape depends on T
only (the grid is sized for the worst routing; blocks past the padded count exit at once), so
a step can be captured in a CUDA graph.

CPU, and the oracle of every test: `fused_moe_reference`, plain PyTorch grouped by expert.
Tile sizes come from kernels/fused_moe_config.py (the sweep's JSON per GPU, or a default).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from minivllm.kernels.fused_moe_config import pick_config
from minivllm.kernels.fused_ops import _jit, triton
from minivllm.kernels.device import num_sms as num_sms_of
from minivllm.kernels.moe_align import moe_align
from minivllm.kernels.pdl import enter_after_previous, pdl_args, prefetch_rows, prefetch_span

if triton is not None:
    import triton.language as tl

    from minivllm.kernels.split_k import split_buffers, store_tile
else:
    tl = None

# one token (batch-1 decode): two GEMV kernels instead of align + grouped GEMMs + k-sum
# (_fused_moe_one_token); MINIVLLM_MOE_DECODE_GEMV=0 keeps the grouped path, to compare
DECODE_GEMV = os.environ.get("MINIVLLM_MOE_DECODE_GEMV", "1") != "0"
# their default tiles (`scripts/sweep_fused_moe.py --decode-gemv` keeps measured ones as the
# "gemv" entry of the M = 1 config). With one token every program's loads are its only memory
# parallelism (no tensor-core loop for Triton to pipeline), so the grids are wide: Qwen3-30B-A3B
# (I 768, H 2048, k 8) gets 8 x 96 up programs and 128 x 8 down programs. Lease 11's first
# version (up 8 x 48, down 128 programs looping over the 8 experts, a reduction per K step)
# read the experts at ~1.5 TB/s: 2.42 ms a token against 2.05 for the grouped path (lease 12, rebuilt: 1.66)
DECODE_GEMV_TILES = {"up": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
                     "down": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4}}
# of each down-projection row (an expert's [H, I] weight), into L2 before the PDL wait (pdl.py)
DOWN_PREFETCH_BYTES = 512
# The streaming variant of the two GEMVs (`_fused_moe_one_token_stream`, the default where it fits):
# a persistent grid of `programs_per_sm` programs a SM, each walking its share of the tiles and
# loading tile t + 1's weights before it computes tile t, so every thread keeps two tiles of loads
# in flight and no program pays a launch prologue per tile. Whole rows per tile: used when H and
# I (rounded up to a power of two) are at most STREAM_MAX_ROW.
# Lease 22 (H100, scripts/bench_moe_decode.py, Qwen3-30B-A3B experts, up and down together):
# 32.7 us with the tiles below against 36.5 for the GEMVs above; a plain read of the same bytes
# takes 27.6. MINIVLLM_MOE_DECODE_STREAM=0 goes back to the GEMVs, to compare.
DECODE_STREAM = os.environ.get("MINIVLLM_MOE_DECODE_STREAM", "1") != "0"
STREAM_TILES = {"up": {"BLOCK_N": 2, "num_warps": 4, "programs_per_sm": 2},
                "down": {"BLOCK_N": 8, "num_warps": 8, "programs_per_sm": 2}}
STREAM_MAX_ROW = 4096


# ------------------------------------------------------------------ the reference (CPU path)


def topk_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]): softmax in fp32, the k
    largest (descending), renormalised to sum 1 when asked (Hugging Face's order of ops)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k] -> [T, H].

    Grouped by expert like the kernel (each expert's weights used once, on all its rows); the
    expert outputs in x's dtype, their weighted sum over k in fp32, then x's dtype. An id of -1
    (an expert another rank holds) contributes nothing."""
    t, k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # the -1 entries first: skipped, their rows stay zero
    start = int((flat < 0).sum())
    counts = torch.bincount(flat[order[start:]], minlength=w13.shape[0]).tolist()
    rows = x.new_zeros(t * k, x.shape[1]) if start else x.new_empty(t * k, x.shape[1])
    for e, c in enumerate(counts):
        if c == 0:
            continue
        entries = order[start:start + c]
        gate_up = F.linear(x[entries // k], w13[e])  # [c, 2I]
        rows[entries] = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])
        start += c
    weighted = rows.view(t, k, x.shape[1]).float() * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


# ------------------------------------------------------------------ public entry points


def _on_triton(*tensors: torch.Tensor) -> bool:
    return triton is not None and all(t.is_cuda for t in tensors)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router on the logits [T, E]: one Triton launch on the GPU, the reference elsewhere."""
    if _on_triton(logits) and logits.stride(-1) == 1:
        return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_reference(logits, top_k, renormalize)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, stats: torch.Tensor | None = None,
              token_valid: torch.Tensor | None = None, local_only: bool = False) -> torch.Tensor:
    """The experts' output [T, H] (see the module docstring). stats: int64 [E] counters that get
    each expert's number of (valid) tokens this call; token_valid: bool [T] (None: all).
    local_only: some ids are -1 (experts of another expert-parallel rank): they add nothing."""
    if _on_triton(x, w13, w2, topk_ids):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, stats=stats, token_valid=token_valid,
                                local_only=local_only)
    if stats is not None:
        count_expert_tokens(stats, topk_ids, token_valid)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)


def count_expert_tokens(stats: torch.Tensor, topk_ids: torch.Tensor, token_valid: torch.Tensor | None) -> None:
    """stats[e] += the number of (valid) tokens routed to expert e (torch ops; the Triton path
    counts inside moe_align)."""
    ids = topk_ids.reshape(-1).long()
    ones = torch.ones_like(ids) if token_valid is None else token_valid.long().repeat_interleave(topk_ids.shape[1])
    # a CUDA graph's padding rows route stale hidden states: their ids may be anything, even past
    # the last expert (NaN router logits), which index_add_ would fault on (a device-side assert
    # under tp + expert parallelism on H100s); moe_align's one-hot ignores them the same way
    inside = (ids >= 0) & (ids < stats.shape[0])
    stats.index_add_(0, torch.where(inside, ids, 0), ones * inside)


# ------------------------------------------------------------------ Triton launchers


def topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        # one warp a token: the reductions over E stay within the warp (shuffles, no barriers)
        _topk_softmax_kernel[(t,)](logits, weights, ids, logits.stride(0), E=e, E_PAD=triton.next_power_of_2(e),
                                   TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize,
                                   num_warps=1, **pdl_args(logits))
    return weights, ids


@functools.lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: dict | None = None, stats: torch.Tensor | None = None,
                     token_valid: torch.Tensor | None = None, local_only: bool = False) -> torch.Tensor:
    """The Triton path (any device: the interpreter tests call it on CPU tensors). config: the
    tile configuration (default: fused_moe_config.pick_config for this GPU and step size).
    local_only: ids of -1 match no expert in moe_align (its one-hot has no column -1), so their
    entries are never computed; their output rows start at zero instead of uninitialised."""
    t, k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    assert x.shape == (t, hidden) and w2.shape == (num_experts, hidden, inter), "fused_moe: shapes disagree"
    if config is None:
        config = pick_config(_device_name(x.device), t, num_experts, inter, hidden, k,
                             str(x.dtype).removeprefix("torch."))
    if t == 0:
        return x.new_empty(0, hidden)
    x = x.contiguous()
    if t == 1 and DECODE_GEMV and DECODE_STREAM and streamable(hidden, inter):
        return _fused_moe_one_token_stream(x, w13, w2, topk_weights, topk_ids, stats, token_valid,
                                           config.get("stream", STREAM_TILES))
    if t == 1 and DECODE_GEMV:
        return _fused_moe_one_token(x, w13, w2, topk_weights, topk_ids, stats, token_valid,
                                    config.get("gemv", DECODE_GEMV_TILES))
    block_m = config["BLOCK_M"]
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, block_m, stats, token_valid)
    num_blocks = block_expert.shape[0]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    hmid = x.new_empty(t * k, inter)
    _grouped_gemm(x, w13, hmid, weights, sorted_ids, block_expert, num_padded, num_blocks, t * k, inter, hidden,
                  a_row_div=k, silu_mul=True, mul_weight=False, block_m=block_m, tile=config["up"])
    out = x.new_zeros(t * k, hidden) if local_only else x.new_empty(t * k, hidden)
    _grouped_gemm(hmid, w2, out, weights, sorted_ids, block_expert, num_padded, num_blocks, t * k, hidden, inter,
                  a_row_div=1, silu_mul=False, mul_weight=True, block_m=block_m, tile=config["down"])
    return out.view(t, k, hidden).sum(dim=1) if k > 1 else out


def _one_token_operands(x, w13, topk_weights, topk_ids):
    """The one-token kernels' operands: (k, I, H, ids [k], fp32 weights [k], hmid [k, I] and
    out [1, H] to fill)."""
    k = topk_ids.shape[1]
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    return (k, inter, hidden, topk_ids.reshape(-1), topk_weights.reshape(-1).to(torch.float32),
            x.new_empty(k, inter), x.new_empty(1, hidden))


def _fused_moe_one_token(x, w13, w2, topk_weights, topk_ids, stats, token_valid, tiles: dict) -> torch.Tensor:
    """One token (batch-1 decode): two GEMV launches instead of align, two grouped GEMMs and the
    k-sum. Its k entries are k distinct experts, so no sorting is needed: program (j, n) of the
    up kernel reads expert ids[j]'s gate and up rows of column tile n (and counts the token for
    that expert); program (n, j) of the down kernel computes expert ids[j]'s weighted output for
    column tile n in fp32, and the tile's last program sums the k of them in a fixed order and
    stores [1, H] once. Issue 21: on Qwen3-30B-A3B's batch-1 decode the align
    and the k-sum were 0.53 of 4.41 ms of kernels a token (lease 9)."""
    k, inter, hidden, ids, weights, hmid, out = _one_token_operands(x, w13, topk_weights, topk_ids)
    up, down = tiles["up"], tiles["down"]  # (the sweep's "gemv" entry of the M = 1 config, or the defaults)
    has_stats = stats is not None
    _moe_decode_up_kernel[(k, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, ids, hmid, stats if has_stats else ids, token_valid if token_valid is not None else ids,
        inter, hidden, w13.stride(0), w13.stride(1), w13.stride(2), HAS_STATS=has_stats,
        HAS_VALID=token_valid is not None, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], num_warps=up["num_warps"], **pdl_args(x))
    tiles_n = triton.cdiv(hidden, down["BLOCK_N"])
    ws, cnt = split_buffers(k, 1, hidden, tiles_n, out)  # the k experts' partials are the "K slices"
    _moe_decode_down_kernel[(tiles_n, k)](
        hmid, w2, ids, weights, out, ws, cnt, hidden, inter, w2.stride(0), w2.stride(1), w2.stride(2), TOP_K=k,
        BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], num_warps=down["num_warps"],
        **prefetch_span(w2.dtype, DOWN_PREFETCH_BYTES, inter), **pdl_args(x))
    return out


def streamable(hidden: int, inter: int) -> bool:
    """Whether the streaming one-token kernels hold whole rows of this shape in registers."""
    return max(triton.next_power_of_2(hidden), triton.next_power_of_2(inter)) <= STREAM_MAX_ROW


def _fused_moe_one_token_stream(x, w13, w2, topk_weights, topk_ids, stats, token_valid, tiles: dict) -> torch.Tensor:
    """The one-token path with persistent, double-buffered GEMVs (see the kernels): the same
    result as `_fused_moe_one_token` up to the order of the fp32 sums. tiles: BLOCK_N, num_warps
    and programs_per_sm of each part ("programs": a fixed program count instead, for tests)."""
    k, inter, hidden, ids, weights, hmid, out = _one_token_operands(x, w13, topk_weights, topk_ids)
    up, down = tiles["up"], tiles["down"]
    sms = num_sms_of(x.device)
    up_tiles = k * triton.cdiv(inter, up["BLOCK_N"])
    has_stats = stats is not None
    _moe_up_stream_kernel[(min(up_tiles, up.get("programs") or sms * up["programs_per_sm"]),)](
        x, w13, ids, hmid, stats if has_stats else ids, token_valid if token_valid is not None else ids,
        inter, hidden, w13.stride(0), w13.stride(1), w13.stride(2), TOP_K=k, K_PAD=triton.next_power_of_2(k),
        HAS_STATS=has_stats, HAS_VALID=token_valid is not None, BLOCK_N=up["BLOCK_N"],
        H_PAD=triton.next_power_of_2(hidden), num_warps=up["num_warps"], **pdl_args(x))
    down_tiles = triton.cdiv(hidden, down["BLOCK_N"])
    _moe_down_stream_kernel[(min(down_tiles, down.get("programs") or sms * down["programs_per_sm"]),)](
        hmid, w2, ids, weights, out, hidden, inter, w2.stride(0), w2.stride(1), w2.stride(2), TOP_K=k,
        K_PAD=triton.next_power_of_2(k), BLOCK_N=down["BLOCK_N"], I_PAD=triton.next_power_of_2(inter),
        num_warps=down["num_warps"], **pdl_args(x))
    return out


def _grouped_gemm(a, w, out, weights, sorted_ids, block_expert, num_padded, num_blocks: int, num_entries: int,
                  n: int, kdim: int, *, a_row_div: int, silu_mul: bool, mul_weight: bool, block_m: int,
                  tile: dict) -> None:
    """out[entry] = act(a[entry // a_row_div] @ w[expert].T) for the sorted entries (see kernel)."""
    bn = tile["BLOCK_N"]
    grid = (num_blocks * triton.cdiv(n, bn),)
    _moe_gemm_kernel[grid](
        a, w, out, weights, sorted_ids, block_expert, num_padded, n, kdim, num_entries, num_blocks,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), n if silu_mul else 0,
        A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=bn,
        BLOCK_K=tile["BLOCK_K"], GROUP_M=tile["GROUP_M"], IEEE=a.dtype == torch.float32, num_warps=tile["num_warps"],
        num_stages=tile["num_stages"])


# ------------------------------------------------------------------ kernels


@_jit
def _moe_decode_up_kernel(x_ptr, w_ptr, ids_ptr, hmid_ptr, stats_ptr, valid_ptr, I, H, stride_we, stride_wn, stride_wk,
                          HAS_STATS: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (j, n): hmid[j, n..] = silu(w13[e, n..] @ x) * (w13[e, I + n..] @ x), e = ids[j],
    as a GEMV in fp32 (one token: no tensor-core tile to fill). The products accumulate in
    [BLOCK_N, BLOCK_K] registers, reduced once after the K loop (a reduction per K step costs
    cross-thread shuffles that the loads then wait for). e < 0 (an expert of another rank):
    nothing (the down kernel skips the entry)."""
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    j = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    if e >= 0:
        if HAS_STATS:
            if n == 0:  # the token counted once for its expert (a padding token not)
                if HAS_VALID:
                    tl.atomic_add(stats_ptr + e, tl.load(valid_ptr).to(tl.int64))
                else:
                    tl.atomic_add(stats_ptr + e, tl.full([], 1, tl.int64))
        cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        ks = tl.arange(0, BLOCK_K)
        base = w_ptr + e * stride_we + tl.where(col_ok, cols, 0)[:, None].to(tl.int64) * stride_wn
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < H
            xv = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            wg = tl.load(base + kk[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
            wu = tl.load(base + I * stride_wn + kk[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
            acc_g += wg.to(tl.float32) * xv
            acc_u += wu.to(tl.float32) * xv
        g = tl.sum(acc_g, axis=1)
        h = g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, axis=1)
        tl.store(hmid_ptr + j * I + cols, h.to(hmid_ptr.dtype.element_ty), mask=col_ok)


@_jit
def _moe_decode_down_kernel(hmid_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, ws_ptr, cnt_ptr, H, I, stride_we,
                            stride_wn, stride_wk, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = 64, LINE: tl.constexpr = 64,
                            PDL: tl.constexpr = False):
    """Program (n, j): weights[j] * (w2[ids[j], n..] @ hmid[j]) in fp32, one program per column
    tile and entry so that the GPU has TOP_K times more programs streaming weights than a
    program per column tile looping over the entries (lease 11: 64 such programs, one per SM at
    most, read at 1.4 TB/s). The TOP_K partials of a tile are summed in the fixed order
    j = 0 .. TOP_K - 1 by its last program (kernels/split_k.py) and stored once in out's dtype.
    Entries with ids[j] < 0 add a zero partial.

    With PDL (kernels/pdl.py) the expert's first PREFETCH weights of each row are requested into
    L2 while the up kernel finishes. ids may be read before the wait: the top-k kernel wrote them
    two launches back, and this kernel starts only after every up program passed its own wait,
    so the top-k grid is complete; the load goes to L2 (.cg), past any stale L1 line."""
    n = tl.program_id(0)
    j = tl.program_id(1)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    part = tl.zeros([BLOCK_N], dtype=tl.float32)
    e = tl.load(ids_ptr + j, cache_modifier=".cg").to(tl.int64)
    base = w_ptr + tl.maximum(e, 0) * stride_we + tl.where(col_ok, cols, 0)[:, None].to(tl.int64) * stride_wn
    if e >= 0:
        prefetch_rows(base, 0, I - 1, PREFETCH, LINE, PDL)
    enter_after_previous(PDL)
    if e >= 0:
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < I
            hv = tl.load(hmid_ptr + j * I + kk, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(base + kk[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * hv[None, :]
        part = tl.sum(acc, axis=1) * tl.load(weights_ptr + j)
    store_tile(part, out_ptr, ws_ptr, cnt_ptr, cols, cols, H, col_ok, j, n, TOP_K)


@_jit
def _expert_of(ids, jj, j):
    """ids[j] of the [K_PAD] register vector ids (jj = arange(K_PAD)), as int64 (0 for j past
    K_PAD: the callers mask such dead tiles)."""
    return tl.sum(tl.where(jj == j, ids, 0), axis=0).to(tl.int64)


@_jit
def _load_up_tile(w_ptr, ids, jj, t, total, tiles_n, I, H, stride_we, stride_wn, stride_wk, rows, ks,
                  BLOCK_N: tl.constexpr):
    """Tile t of the up GEMV (entry j = t // tiles_n, rows n * BLOCK_N .. of its expert's gate
    and up halves, whole rows): ([BLOCK_N, H_PAD] gate, the same of up) in the weights' dtype,
    zeros where t >= total, the expert is another rank's (id < 0), or past I / H."""
    j = t // tiles_n
    e = _expert_of(ids, jj, j)
    cols = (t % tiles_n) * BLOCK_N + rows
    rows_left = tl.where((t < total) & (e >= 0), I, 0)  # a dead tile loads nothing
    ok = (cols < rows_left)[:, None] & (ks < H)[None, :]
    ptrs = (w_ptr + tl.maximum(e, 0) * stride_we + tl.where(cols < I, cols, 0)[:, None].to(tl.int64) * stride_wn
            + ks[None, :] * stride_wk)
    return tl.load(ptrs, mask=ok, other=0.0), tl.load(ptrs + I * stride_wn, mask=ok, other=0.0)


@_jit
def _moe_up_stream_kernel(x_ptr, w_ptr, ids_ptr, hmid_ptr, stats_ptr, valid_ptr, I, H, stride_we, stride_wn,
                          stride_wk, TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_STATS: tl.constexpr,
                          HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr, H_PAD: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Persistent up GEMV of one token: program p computes tiles p, p + P, p + 2P, ... of the
    TOP_K * cdiv(I, BLOCK_N) tiles (tile t: entry j = t // tiles_n, hmid[j, n * BLOCK_N ..] =
    silu(gate rows @ x) * (up rows @ x) over whole rows of H, in fp32). Tile t + P's weights are
    loaded before tile t is computed: two tiles of loads in flight per thread, one prologue per
    program. Entries of another rank's experts (id < 0) store nothing (the down kernel skips
    them). Program 0 counts the token once for each of its experts."""
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    jj = tl.arange(0, K_PAD)
    ids = tl.load(ids_ptr + jj, mask=jj < TOP_K, other=-1).to(tl.int32)
    if HAS_STATS:
        if p == 0:
            if HAS_VALID:
                inc = tl.load(valid_ptr).to(tl.int64)
            else:
                inc = 1
            tl.atomic_add(stats_ptr + tl.maximum(ids, 0), tl.zeros([K_PAD], tl.int64) + inc, mask=ids >= 0)
    tiles_n = tl.cdiv(I, BLOCK_N)
    total = TOP_K * tiles_n
    rows = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    xv = tl.load(x_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)[None, :]
    wg, wu = _load_up_tile(w_ptr, ids, jj, p, total, tiles_n, I, H, stride_we, stride_wn, stride_wk, rows, ks,
                           BLOCK_N)
    for t in range(p, total, P):
        wg_next, wu_next = _load_up_tile(w_ptr, ids, jj, t + P, total, tiles_n, I, H, stride_we, stride_wn,
                                         stride_wk, rows, ks, BLOCK_N)
        g = tl.sum(wg.to(tl.float32) * xv, axis=1)
        h = g / (1.0 + tl.exp(-g)) * tl.sum(wu.to(tl.float32) * xv, axis=1)
        j = t // tiles_n
        cols = (t % tiles_n) * BLOCK_N + rows
        rows_left = tl.where(_expert_of(ids, jj, j) >= 0, I, 0)  # another rank's expert: no store
        tl.store(hmid_ptr + j * I + cols, h.to(hmid_ptr.dtype.element_ty), mask=cols < rows_left)
        wg, wu = wg_next, wu_next


@_jit
def _load_down_step(w_ptr, hmid_ptr, ids, jj, u, steps, TOP_K: tl.constexpr, n, H, I, stride_we, stride_wn,
                    stride_wk, rows, ks, BLOCK_N: tl.constexpr):
    """Step u of a down program (entry j = u % TOP_K of its column tile): ([BLOCK_N, I_PAD]
    weight rows of expert ids[j], [I_PAD] hmid[j]); zeros past the program's steps, for
    another rank's expert, or past H / I."""
    j = u % TOP_K
    e = _expert_of(ids, jj, j)
    cols = n * BLOCK_N + rows
    width = tl.where((u < steps) & (e >= 0), I, 0)  # a dead step loads nothing
    ok = (cols < H)[:, None] & (ks < width)[None, :]
    ptrs = (w_ptr + tl.maximum(e, 0) * stride_we + tl.where(cols < H, cols, 0)[:, None].to(tl.int64) * stride_wn
            + ks[None, :] * stride_wk)
    return tl.load(ptrs, mask=ok, other=0.0), tl.load(hmid_ptr + j * I + ks, mask=ks < width, other=0.0)


@_jit
def _moe_down_stream_kernel(hmid_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, H, I, stride_we, stride_wn, stride_wk,
                            TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                            I_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """Persistent down GEMV of one token with the weighted k-sum: program p owns column tiles
    n = p, p + P, ... of out [1, H]; for each it adds weights[j] * (w2[ids[j], n-tile] @ hmid[j])
    for j = 0 .. TOP_K - 1 in that fixed order in fp32 and stores the tile once (no workspace,
    no cross-program fix-up). Its (tile, j) steps run as one loop that loads step u + 1's rows
    before computing step u. Entries with ids[j] < 0 add zero. (Asking L2 for 512 bytes of each
    row of the first tile before the PDL wait, as _moe_decode_down_kernel does, measured slower
    here: 3.61 against 3.47 ms a token on W10-decode, lease 23; removed.)"""
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    jj = tl.arange(0, K_PAD)
    rows = tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + jj, mask=jj < TOP_K, other=-1).to(tl.int32)
    wts = tl.load(weights_ptr + jj, mask=jj < TOP_K, other=0.0)
    tiles_n = tl.cdiv(H, BLOCK_N)
    my_tiles = tl.cdiv(tiles_n - p, P)
    steps = my_tiles * TOP_K
    ks = tl.arange(0, I_PAD)
    w, hv = _load_down_step(w_ptr, hmid_ptr, ids, jj, 0, steps, TOP_K, p, H, I, stride_we, stride_wn, stride_wk,
                            rows, ks, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for u in range(0, steps):
        un = u + 1
        w_next, hv_next = _load_down_step(w_ptr, hmid_ptr, ids, jj, un, steps, TOP_K, p + (un // TOP_K) * P, H, I,
                                          stride_we, stride_wn, stride_wk, rows, ks, BLOCK_N)
        j = u % TOP_K
        wj = tl.sum(tl.where(jj == j, wts, 0.0), axis=0)
        acc += tl.sum(w.to(tl.float32) * hv.to(tl.float32)[None, :], axis=1) * wj
        if j == TOP_K - 1:
            cols = (p + (u // TOP_K) * P) * BLOCK_N + rows
            tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        w, hv = w_next, hv_next


@_jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, stride_t, E: tl.constexpr, E_PAD: tl.constexpr,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
    """One program (one warp) per token: softmax over E logits in fp32, the TOP_K largest by
    repeated argmax (ties: the lowest expert id), kept in registers, optionally renormalised,
    then stored with one vector store each."""
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    t = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    ks = tl.arange(0, K_PAD)
    x = tl.load(logits_ptr + t * stride_t + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(cols < E, p, -1.0)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, E_PAD), axis=0)
        ids = tl.where(ks == j, idx, ids)
        w = tl.where(ks == j, best, w)
        p = tl.where(cols == idx, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    tl.store(ids_ptr + t * TOP_K + ks, ids, mask=ks < TOP_K)
    tl.store(weights_ptr + t * TOP_K + ks, w, mask=ks < TOP_K)


@_jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; IEEE: full fp32 products (fp32 inputs), else the default (tf32 for fp32)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@_jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                     N, K, num_entries, num_blocks, stride_am, stride_we, stride_wn, stride_wk, stride_om, up_offset,
                     A_ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     IEEE: tl.constexpr):
    """Program (block b, column tile n) of a grouped GEMM over the expert-sorted entries.

    Rows: sorted_ids[b * BLOCK_M ..] (entries; >= num_entries marks padding), A row =
    entry // A_ROW_DIV; expert = block_expert[b]. SILU_MUL: acc_gate over w rows n.., acc_up
    over rows up_offset + n.., stored silu(acc_gate) * acc_up. MUL_WEIGHT: rows scaled by
    weights[entry]. out[entry, n..] in out's dtype."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks share each column tile of weights while in cache
    width = GROUP_M * tiles_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_entries
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, IEEE)
        if SILU_MUL:
            w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = _dot(a, w_up, acc_up, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
