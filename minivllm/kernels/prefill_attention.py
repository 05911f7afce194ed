"""Triton kernel: variable-length causal attention over the paged KV cache, one launch per step.

Serves every step that has a sequence with more than one new token (fresh prompts, prefill
chunks, prefix-cache hits, mixed prefill + decode batches). The reference is
`paged_attention_reference` in minivllm/attention/reference.py.

Work split (flash-attention style, online softmax in fp32, exp2 with the scale folded in):

    grid = (num_tokens // BLOCK_Q + num_seqs, num_kv_heads)

    A program owns one *query tile* of one sequence and one kv head. Its BLOCK_M rows are
    (query token, query head) pairs: row r = query token r // GROUP of the tile, query head
    kv_head * GROUP + r % GROUP. So all GROUP query heads sharing a kv head run in one
    program and every K/V tile is loaded once per kv head (GQA), BLOCK_Q = BLOCK_M // GROUP.

    Tiles are numbered per sequence from start_tile(s) = query_start_loc[s] // BLOCK_Q + s;
    these ranges never overlap and all fit below num_tokens // BLOCK_Q + num_seqs, so the
    grid depends only on shapes (CUDA-graph friendly) and a program finds its sequence by a
    binary search over query_start_loc. Programs past the end of their sequence exit at once.

With skip_single_token, sequences with exactly one new token are left alone: a mixed step
serves those (its decode rows) with the decode kernel, which reads their keys faster.

Keys: query token j of a sequence sits at position ctx + j (ctx = seq_len - q_len cached
tokens) and sees keys 0..ctx + j. A tile first walks the keys every one of its rows sees
(no mask), then the last few key tiles with the causal mask. Keys are gathered from the
paged cache through the block table: key n lives in block block_table[n // block_size] at
offset n % block_size, so BLOCK_N does not have to match the cache block size.

FP8 (e4m3) caches: K/V tiles are widened to the query's dtype in registers, k_scale is folded
into the softmax scale and v_scale into the normalized output.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.paged_checks import check_paged_shapes
from minivllm.kernels.store_kv import fp8_widen_f16, kv_scale_args

LOG2E = math.log2(math.e)


@triton.jit
def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence s with start_tile(s) = qsl[s] // BLOCK_Q + s <= tile (binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE: full fp32 products for fp32 inputs. TF32 (the default
    for fp32) keeps 10 mantissa bits, so an fp32 engine on the GPU would otherwise give answers
    that depend on the path (a prefix hit vs a full prefill) at the 1e-3 level."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def fp16_query(q):
    """A 16-bit query in float16, for products with FP8 K/V tiles widened to float16 (WIDEN_F16),
    clamped to float16's range."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def softmax_accumulate(acc, m_i, l_i, s, v, IEEE: tl.constexpr, ROWSUM_MMA: tl.constexpr = False):
    """One key tile of the online softmax: rows' scores s [R, BLOCK_N] (log2 domain, masked keys
    -inf, each row's running max finite afterwards) and values v [BLOCK_N, D] into the running
    (acc [R, D] unnormalized, m_i [R] max, l_i [R] sum of 2^(s - m_i)). Shared by the prefill and
    decode kernels.

    ROWSUM_MMA: the tile's row sums on the tensor cores, as P (in v's dtype, the P of the PV
    product) times a ones matrix, instead of tl.sum's tree over the threads that hold the row.
    That tree follows the tile's layout (BLOCK_M, warps); an MMA's sum over its K dimension did not
    change with the tile in any of 1,630 launches of kernels/invariant_gemm.py (lease 28), and the
    max and the elementwise ops are exact, so with it a row's bits would depend on BLOCK_N alone
    (a batch-invariant candidate; scripts/bench_invariant_attention.py checks it on the GPU)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if ROWSUM_MMA:
        pv = p.to(v.dtype)
        # every column of P @ ones is the row sum; max picks one of the equal values exactly
        l_i = l_i * alpha + tl.max(mma(pv, tl.full([v.shape[0], 16], 1.0, v.dtype), IEEE), 1)
        acc = acc * alpha[:, None] + mma(pv, v, IEEE)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _attend_key_range(
    acc, m_i, l_i,  # [BLOCK_M, D_PAD] fp32, [BLOCK_M] fp32, [BLOCK_M] fp32: running state
    q,  # [BLOCK_M, D_PAD] query rows (cache dtype)
    q_pos,  # [BLOCK_M] int32 absolute position of each row's query token
    k_base, v_base,  # cache pointers already offset to this kv head
    bt_row,  # this sequence's block table row
    start, end,  # key range [start, end); start is a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e)
    stride_cb, stride_cs, stride_cd,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr,
    ROWSUM_MMA: tl.constexpr = False,
):
    d = tl.arange(0, D_PAD)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_valid = n < end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs  # [BLOCK_N] int64
        k_ptrs = k_base + kv_off[None, :] + d[:, None] * stride_cd  # [D_PAD, BLOCK_N]
        v_ptrs = v_base + kv_off[:, None] + d[None, :] * stride_cd  # [BLOCK_N, D_PAD]
        if MASKED or HEAD_DIM != D_PAD:
            k_t = tl.load(k_ptrs, mask=n_valid[None, :] & (d < HEAD_DIM)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        else:  # interior tiles: every key is < end, no mask needed
            k_t = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if KV_FP8:  # widened in registers; the scales are folded in by the caller
            k_t, v = k_t.to(q.dtype), v.to(q.dtype)
        s = mma(q, k_t, IEEE) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 domain
        if MASKED:
            causal = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            s = tl.where(causal, s, float("-inf"))
        # every row sees key 0, which lies in the first tile walked: m_new is finite from then on
        acc, m_i, l_i = softmax_accumulate(acc, m_i, l_i, s, v, IEEE, ROWSUM_MMA)
    return acc, m_i, l_i


# num_seqs and the block-table width change every step: without do_not_specialize Triton would
# compile a variant for each of their "== 1" / "multiple of 16" classes (~1 s each, mid-serving)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qsl_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    num_seqs,
    qk_scale,
    k_scale_ptr, v_scale_ptr,  # [1] float32: an FP8 cache holds K / k_scale, V / v_scale (read when KV_FP8)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    BLOCK_Q: tl.constexpr,  # query tokens per tile (BLOCK_M // GROUP)
    BLOCK_M: tl.constexpr,  # rows per tile (power of two >= 16)
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    SKIP_SINGLE: tl.constexpr,  # leave one-token queries to the decode kernel
    ALL_MASKED: tl.constexpr,  # every key tile through the masked path (batch-invariant mode)
    KV_FP8: tl.constexpr,  # K/V are float8 e4m3: widened (WIDEN_F16: to float16, else the query's dtype)
    IEEE: tl.constexpr,  # float32 cache: full-precision products (tl.dot's default is TF32)
    WIDEN_F16: tl.constexpr = False,  # FP8 only: the products in float16 (decode_attention's docstring)
    ROWSUM_MMA: tl.constexpr = False,  # the softmax row sums on the tensor cores (softmax_accumulate)
):
    # reversed: within a sequence the last tiles see the most keys, so start them first
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    q_tile_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= q_len:
        return  # spare program: the grid is an upper bound on the number of tiles
    if SKIP_SINGLE and q_len == 1:
        return  # a decode row: the decode kernel's
    ctx = tl.load(seq_lens_ptr + seq) - q_len  # cached tokens before the first new one

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile_start + rows // GROUP  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx + tok
    d = tl.arange(0, D_PAD)
    io_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    t64 = (q_begin + tok).to(tl.int64)
    q_off = t64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if WIDEN_F16:
            q = fp16_query(q)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys 0..ctx + q_tile_start are seen by every row: whole tiles of them need no mask.
    # ALL_MASKED (batch-invariant mode) walks every tile through the masked path instead: where
    # the unmasked part ends depends on the row's query tile and on how much of its sequence
    # was cached (chunked prefill, a prefix hit), and the two paths differ in the last bit (the
    # masked one's `where` keeps the compiler from fusing the scale into the exponent: 1-ulp
    # changes, found by scripts/diagnose_invariance.py at one row of layer 9)
    full_end = 0 if ALL_MASKED else (ctx + q_tile_start + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx + tl.minimum(q_tile_start + BLOCK_Q, q_len)  # one past the last key needed
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, 0, full_end, qk_scale,
        stride_cb, stride_cs, stride_cd, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, KV_FP8, IEEE, ROWSUM_MMA)
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, k_base, v_base, bt_row, full_end, kv_end, qk_scale,
        stride_cb, stride_cs, stride_cd, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, KV_FP8, IEEE, ROWSUM_MMA)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only padding rows can have l == 0
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    o_off = t64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# batch-invariant mode's launch options over prefill_config's, one for every row of every step:
# 128 keys a tile, 4 warps, 3 stages, the fastest in scripts/bench_invariant_attention.py's sweep
# on W1-like decode rows (lease 30, H100: 852 us over its four cases against 892 for prefill_config's
# 64 keys and 2 stages; W1-bi +1.4 %). MINIVLLM_INVARIANT_ATTN="BLOCK_N,warps,stages" replaces it
# (A/B runs). A launch changes the mode's bits (the online softmax's key tiles, the row sums'
# tree), never their invariance: every row gets the same one.
INVARIANT_ENV = "MINIVLLM_INVARIANT_ATTN"
INVARIANT_LAUNCH = dict(zip(("BLOCK_N", "num_warps", "num_stages"),
                            map(int, os.environ.get(INVARIANT_ENV, "128,4,3").split(","))))


def prefill_config(group: int, head_dim: int, max_query_len: int, elem_bytes: int = 2,
                   invariant: bool = False) -> dict[str, int]:
    """Tile sizes and launch options (the tuning knobs, bf16/fp16).

    BLOCK_M rows hold BLOCK_M // group query tokens; a step whose longest query is short
    (e.g. mostly decode tokens) gets a smaller BLOCK_M so fewer rows are wasted. fp32 (and
    head_dim > 128) halve BLOCK_N to stay within registers and shared memory.
    BLOCK_M is at most 64: on an H200 (scripts/sweep_prefill_config.py, Qwen3-8B heads) 64 rows,
    64 keys, 4 warps, 2 stages gave 198 TFLOP/s on a burst of 8 fresh prompts and 70 on one
    prompt beside 60 decode rows, against 169 and 44 with 128 rows and 8 warps.
    invariant (batch-invariant mode): the mode's own INVARIANT_LAUNCH over these, for 16-bit K/V
    with head_dim <= 128, the measured case; fp32 and head_dim > 128 keep the narrower key tiles
    (shared memory).
    """
    big = head_dim > 128 or elem_bytes > 2
    rows_needed = triton.next_power_of_2(max(1, max_query_len) * group)
    block_m = max(16, triton.next_power_of_2(group), min(64, rows_needed))
    cfg = {
        "BLOCK_M": block_m,
        "BLOCK_N": 32 if big else 64,
        "num_warps": 8 if block_m >= 128 else 4,
        "num_stages": 2,
    }
    if invariant and not big:
        cfg.update(INVARIANT_LAUNCH)
    return cfg


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 (device)
    seq_lens: torch.Tensor,  # [num_seqs] int32 (device), cached + new tokens
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 (device)
    scale: float,
    max_query_len: int | None = None,  # host int; only picks the tile size (None: from num_tokens)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; allocated if None
    skip_single_token: bool = False,  # leave rows of one-token sequences untouched (decode kernel's)
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only (None: 1.0)
    v_scale: torch.Tensor | None = None,
    invariant: bool = False,  # batch-invariant mode: a row's bits never depend on its query tile or chunk
    config: dict | None = None,  # launch options replacing prefill_config's (sweeps: bench_invariant_attention.py)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole paged context.

    The new tokens' K/V must already be in the cache. Rows of `out` past
    query_start_loc[-1] (padding) are left untouched. The launch depends only on shapes and
    on max_query_len, so under CUDA-graph capture pass a fixed max_query_len (or None).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_paged_shapes(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_scale, v_scale = kv_scale_args(fp8, k_scale, v_scale, k_cache)
    cfg = prefill_config(group, head_dim, num_tokens if max_query_len is None else max_query_len,
                         query.element_size() if fp8 else k_cache.element_size(), invariant)
    cfg.update(config or {})
    block_q = cfg["BLOCK_M"] // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        num_seqs, scale * LOG2E, k_scale, v_scale,
        *query.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, SKIP_SINGLE=skip_single_token, ALL_MASKED=invariant, KV_FP8=fp8,
        IEEE=k_cache.dtype == torch.float32, WIDEN_F16=fp8_widen_f16(query), **cfg,
    )
    return out

