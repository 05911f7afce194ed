"""Triton kernels: decode attention (one new token per sequence) over the paged KV cache.

Flash-decoding: each sequence's context is cut into up to `num_splits` chunks, one program
per (sequence, kv head, chunk), and a second small kernel merges the chunks.

    stage 1  grid = (num_seqs, num_kv_heads, num_splits)
             program (s, h, c) attends the GROUP query heads of kv head h (one tl.dot over a
             head dimension padded to G_PAD >= 16, so each K/V tile is read once per kv head)
             to keys [c * chunk, min((c + 1) * chunk, seq_len)) and writes a normalized partial
             output and its log-sum-exp (base 2) to the scratch buffers.
             chunk = max(MIN_CHUNK, round_up(cdiv(seq_len, num_splits), BLOCK_N)) is computed
             in the kernel from the device seq_lens, so short sequences use fewer chunks; a
             program whose chunk starts past seq_len exits before the PDL wait (SKIP_EMPTY, with
             the merge below; it reads the step's metadata through L2 first, which no kernel of
             the step writes) or, with MINIVLLM_DECODE_SKIP_EMPTY=0 or the merge kernel, writes a
             neutral partial (lse = -inf, 0).
    stage 2  out = sum_c 2^(lse_c - max) * o_c / sum_c 2^(lse_c - max), by the last stage-1 program
             of each (sequence, kv head) to finish (its int32 counter, as kernels/split_k.py's
             fix-up counts a tile's K slices; with SKIP_EMPTY only the chunks that hold keys
             count), over the chunks that hold keys: one launch a
             layer. MINIVLLM_DECODE_MERGE=kernel runs it as a second kernel instead,
             grid = (num_seqs, num_heads) (the layout before 2026-11-28, for A/B runs).

With num_splits == 1 stage 1 writes the final output and stage 2 is skipped.

FP8 (e4m3) caches: each K/V tile is widened in registers to float16 (one `cvt.rn.f16x2.e4m3x2`
per two values on sm89+; widening to bfloat16 takes that and two more conversions), and the
query and the probabilities join it in float16 (a 16-bit query clamped to float16's range; a
float32 query keeps float32; products still accumulate in float32). k_scale is folded into the
softmax scale and v_scale into the normalized output (per-tensor scales).
MINIVLLM_FP8_KV_WIDEN=query widens to the query's dtype instead (the layout before lease 17;
lease 17: 3-7 % slower on W11-like batches, `scripts/bench_decode_variants.py`).

Only sequences with exactly one new token are attended; others (zero-length padding, and the
prompt chunks of a mixed step, which the prefill kernel serves) are left alone, so a mixed
step runs this kernel for its decode rows and the prefill kernel for the rest.

CUDA graphs: the launch depends only on shapes and on `num_splits`; pass a fixed num_splits
and preallocated scratch buffers (`DecodeWorkspace`) and nothing host-side changes between
replays. The reference is `paged_attention_reference` in minivllm/attention/reference.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels.device import num_sms as num_sms_of
from minivllm.kernels.paged_checks import check_paged_shapes
from minivllm.kernels.pdl import enter_after_previous, pdl_args
from minivllm.kernels.prefill_attention import fp16_query, mma, softmax_accumulate
from minivllm.kernels.split_k import tile_counters
from minivllm.kernels.store_kv import fp8_widen_f16, kv_scale_args

LOG2E = math.log2(math.e)
MIN_CHUNK = 128  # fewest keys per split: below this the merge costs more than it saves
MAX_SPLITS = 64  # most chunks per sequence
PROGRAMS_PER_SM = 4  # split until about this many stage-1 programs per SM


def skip_empty_enabled() -> bool:
    """SKIP_EMPTY (programs of empty chunks exit before the PDL wait) where it applies, unless
    MINIVLLM_DECODE_SKIP_EMPTY=0 (A/B runs). Read at each launch."""
    return os.environ.get("MINIVLLM_DECODE_SKIP_EMPTY", "1") != "0"


def merge_in_split() -> bool:
    """Stage 2 in the stage-1 kernel (the last program of each sequence and kv head merges),
    unless MINIVLLM_DECODE_MERGE=kernel. Read at each launch, so a benchmark or test can flip it."""
    return os.environ.get("MINIVLLM_DECODE_MERGE", "split") != "kernel"


@dataclass
class DecodeWorkspace:
    """Scratch for the split partials; preallocate once to keep CUDA-graph replays static."""

    part_out: torch.Tensor  # [max_num_seqs, num_heads, num_splits, head_dim] fp32
    part_lse: torch.Tensor  # [max_num_seqs, num_heads, num_splits] fp32, log2 domain

    @property
    def num_splits(self) -> int:
        return self.part_lse.shape[2]

    @staticmethod
    def allocate(
        max_num_seqs: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
    ) -> DecodeWorkspace:
        return DecodeWorkspace(
            part_out=torch.empty(max_num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            part_lse=torch.empty(max_num_seqs, num_heads, num_splits, dtype=torch.float32, device=device),
        )


@triton.jit
def _attend_chunk(q, k_base, v_base, bt_row, start, end, qk_scale, stride_cs, stride_cb, stride_cd,
                  G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax of q [G_PAD, D_PAD] over keys [start, end): S = q K^T, O += P V.
    -> (acc [G_PAD, D_PAD] fp32 unnormalized, m_i [G_PAD], l_i [G_PAD]) in the log2 domain."""
    d = tl.arange(0, D_PAD)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_valid = n < end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs  # [BLOCK_N] int64
        k_t = tl.load(k_base + kv_off[None, :] + d[:, None] * stride_cd,
                      mask=n_valid[None, :] & (d < HEAD_DIM)[:, None], other=0.0)  # [D_PAD, BLOCK_N]
        v = tl.load(v_base + kv_off[:, None] + d[None, :] * stride_cd,
                    mask=n_valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [BLOCK_N, D_PAD]
        if KV_FP8:
            k_t, v = k_t.to(q.dtype), v.to(q.dtype)
        s = mma(q, k_t, IEEE) * qk_scale  # [G_PAD, BLOCK_N] fp32, log2 domain
        s = tl.where(n_valid[None, :], s, float("-inf"))
        # each tile holds at least one valid key (n0 < end), so the running max is finite
        acc, m_i, l_i = softmax_accumulate(acc, m_i, l_i, s, v, IEEE)
    return acc, m_i, l_i


@triton.jit
def _chunk_keys(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK_N: tl.constexpr):
    """Keys a chunk of this sequence: its share of num_splits chunks rounded up to BLOCK_N, at
    least MIN_CHUNK_N (so short sequences fill fewer chunks)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK_N)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])  # per-step values: one compiled variant
def _decode_split_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]; written only when NUM_SPLITS_IS_ONE
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32
    qsl_ptr,  # [num_seqs + 1] int32; decode: query token of sequence s is qsl[s]
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    cnt_ptr,  # MERGE: int32 [num_seqs * num_kv_heads] counters, 0 on entry and on exit (split_k.tile_counters)
    num_splits,
    qk_scale,  # softmax scale * log2(e)
    k_scale_ptr, v_scale_ptr,  # [1] float32: an FP8 cache holds K / k_scale, V / v_scale (read when KV_FP8)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_ps, stride_ph, stride_pc, stride_pd,
    stride_ls, stride_lh, stride_lc,
    GROUP: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,  # max(16, next_pow2(GROUP)): tl.dot needs >= 16 rows
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    MIN_CHUNK_N: tl.constexpr,  # MIN_CHUNK rounded up to a multiple of BLOCK_N
    NUM_SPLITS_IS_ONE: tl.constexpr,
    KV_FP8: tl.constexpr,  # K/V tiles are float8 e4m3: widened (WIDEN_F16: to float16, else the query's dtype)
    IEEE: tl.constexpr,  # float32 cache: full-precision products (prefill_attention.mma)
    WIDEN_F16: tl.constexpr = False,  # FP8 only: the products in float16 (module docstring)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    MERGE: tl.constexpr = False,  # split: the last program of (seq, kv head) merges the chunks (stage 2)
    S_PAD: tl.constexpr = 2,  # MERGE: next_pow2(num_splits)
    SKIP_EMPTY: tl.constexpr = False,  # (MERGE or one split) a program whose chunk holds no key exits at once
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SKIP_EMPTY:
        # The step's metadata is written before its first kernel, never by the kernel before
        # this one (rotary / K/V store), so it is read before the PDL wait, through L2. A program
        # whose chunk starts past seq_len (at batch 1 and a 384-token context, 29 of every 32)
        # exits without storing or counting: the merge counts the used chunks only
        token = tl.load(qsl_ptr + seq, cache_modifier=".cg")
        q_len = tl.load(qsl_ptr + seq + 1, cache_modifier=".cg") - token
        seq_len = tl.load(seq_lens_ptr + seq, cache_modifier=".cg")
        chunk = _chunk_keys(seq_len, num_splits, BLOCK_N, MIN_CHUNK_N)
        if (q_len != 1) | (split * chunk >= seq_len):
            return  # not a one-token query (padding, a prompt chunk), or an empty chunk
        enter_after_previous(PDL)  # before any read of q or the cache, and any store
    else:
        enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
        token = tl.load(qsl_ptr + seq)
        if tl.load(qsl_ptr + seq + 1) - token != 1:
            return  # not a one-token query: padding (0) or a prompt chunk (the prefill kernel's)
        seq_len = tl.load(seq_lens_ptr + seq)
        chunk = _chunk_keys(seq_len, num_splits, BLOCK_N, MIN_CHUNK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)  # empty when start >= seq_len

    g = tl.arange(0, G_PAD)
    head = kv_head * GROUP + g  # [G_PAD]
    d = tl.arange(0, D_PAD)
    io_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    t64 = token.to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=io_mask, other=0.0)  # [G_PAD, D_PAD]
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # s = q . (K / k_scale) * (scale * k_scale)
        if WIDEN_F16:
            q = fp16_query(q)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_chunk(q, k_base, v_base, bt_row, start, end, qk_scale, stride_cs, stride_cb, stride_cd,
                                  G_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, KV_FP8, IEEE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty chunk: acc == 0, keep the partial at 0
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    if NUM_SPLITS_IS_ONE:
        o_off = t64 * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # [G_PAD]
        s64 = seq.to(tl.int64)
        p_base = part_out_ptr + s64 * stride_ps + head[:, None] * stride_ph + d[None, :] * stride_pd
        l_base = part_lse_ptr + s64 * stride_ls + head * stride_lh
        tl.store(p_base + split * stride_pc, o, mask=io_mask)
        tl.store(l_base + split * stride_lc, lse, mask=g < GROUP)
        if MERGE:
            # Visibility as in split_k.store_tile: the CTA barrier orders every thread's partial
            # before the (acq_rel, gpu-scope) increment; the last program's acquire then sees all
            # num_splits partials, read through L2 (.cg)
            tl.debug_barrier()
            counter = cnt_ptr + seq * tl.num_programs(1) + kv_head
            n_used = tl.cdiv(seq_len, chunk)  # chunks past it hold no keys (weight 0): not merged
            if tl.atomic_add(counter, 1) == (n_used if SKIP_EMPTY else num_splits) - 1:
                res = _merge_chunks(p_base, l_base, g < GROUP, io_mask, n_used, stride_pc, stride_lc,
                                    G_PAD, D_PAD, S_PAD)
                o_off = t64 * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
                tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=io_mask)
                tl.store(counter, 0)  # every program has counted: 0 again for the next launch (graph replays too)


@triton.jit
def _merge_chunks(p_base, l_base, g_ok, io_mask, n_used, stride_pc, stride_lc,
                  G_PAD: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Stage 2 for one kv head's query heads: p_base [G_PAD, D_PAD] pointers to chunk 0's
    normalized partials, l_base [G_PAD] to its log-sum-exps (base 2) -> [G_PAD, D_PAD] float32
    sum_c 2^(lse_c - max) o_c / sum_c 2^(lse_c - max), over the chunks 0 .. n_used - 1 that hold
    keys (later ones weigh 0, and with SKIP_EMPTY nothing is stored for them)."""
    c = tl.arange(0, S_PAD)
    lse = tl.load(l_base[:, None] + c[None, :] * stride_lc, mask=g_ok[:, None] & (c < n_used)[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [G_PAD, S_PAD]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every chunk empty (seq_len 0): output 0
    den = tl.sum(tl.exp2(lse - m[:, None]), 1)
    den = tl.where(den == 0.0, 1.0, den)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for i in range(0, n_used):
        lse_i = tl.load(l_base + i * stride_lc, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
        o_i = tl.load(p_base + i * stride_pc, mask=io_mask, other=0.0, cache_modifier=".cg")
        acc += o_i * tl.exp2(lse_i - m)[:, None]
    return acc / den[:, None]


@triton.jit
def _decode_merge_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32
    qsl_ptr,  # [num_seqs + 1] int32
    num_splits,
    stride_ot, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pc, stride_pd,
    stride_ls, stride_lh, stride_lc,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,  # next_pow2(num_splits)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    enter_after_previous(PDL)  # first: no read of another kernel's output or store before it (kernels/pdl.py)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - token != 1:
        return  # as in stage 1: not a one-token query
    c = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s64 = seq.to(tl.int64)
    lse = tl.load(part_lse_ptr + s64 * stride_ls + head * stride_lh + c * stride_lc,
                  mask=c < num_splits, other=float("-inf"))  # [S_PAD]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all chunks empty (seq_len 0): output 0
    w = tl.exp2(lse - m)  # [S_PAD], 0 for empty chunks
    o_mask = (c < num_splits)[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(part_out_ptr + s64 * stride_ps + head * stride_ph + c[:, None] * stride_pc + d[None, :] * stride_pd,
                mask=o_mask, other=0.0)  # [S_PAD, D_PAD]
    den = tl.sum(w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    res = tl.sum(o * w[:, None], 0) / den  # [D_PAD]
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """How many chunks to cut each context into so that stage 1 fills the GPU.

    Split only while there are fewer than PROGRAMS_PER_SM * num_sms (seq, kv head) programs,
    never below MIN_CHUNK keys per chunk nor above MAX_SPLITS chunks. Rounded up to a power of
    two so few kernel variants get compiled.
    """
    programs = max(1, num_seqs * num_kv_heads)
    target = PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs), triton.cdiv(max(1, max_seq_len), MIN_CHUNK), MAX_SPLITS)
    return triton.next_power_of_2(max(1, splits))


def decode_config(group: int, head_dim: int, elem_bytes: int = 2) -> dict[str, int]:
    """Tile sizes and launch options (the tuning knobs).

    BLOCK_N keys of at most 256 bytes each -> 128 keys per iteration (32 KB of K and of V per
    stage): on an H200 (scripts/sweep_decode_attention.py, Qwen3-8B heads, W3-like contexts)
    128 keys, 4 warps, 3 stages read K/V at 3.1-3.3 TB/s at batch 110 against 2.75 TB/s with
    64 keys. Wider rows (fp32, head_dim > 128) halve it to stay within shared memory.
    """
    row_bytes = head_dim * elem_bytes
    return {
        "BLOCK_N": 128 if row_bytes <= 256 else 64 if row_bytes <= 512 else 32,
        "num_warps": 4,
        "num_stages": 3,
    }


def decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]; token of sequence s = query_start_loc[s]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 (device); decode: 0, 1, 2, ...
    seq_lens: torch.Tensor,  # [num_seqs] int32 (device)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 (device)
    scale: float,
    max_seq_len: int | None = None,  # host int, used only to choose num_splits
    num_splits: int | None = None,  # fixed split count (CUDA graphs); default: choose_num_splits
    workspace: DecodeWorkspace | None = None,  # preallocated scratch (CUDA graphs)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; allocated if None
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches only (None: 1.0)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's single new token over its whole paged context."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    check_paged_shapes(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = workspace.num_splits if workspace is not None else _default_splits(
            query, num_seqs, num_kv_heads, max_seq_len, k_cache, block_tables)
    if num_splits > 1 and workspace is None:
        workspace = DecodeWorkspace.allocate(num_seqs, num_heads, head_dim, num_splits, query.device)
    if workspace is not None:
        assert workspace.part_lse.shape[0] >= num_seqs and workspace.part_lse.shape[1] == num_heads
        assert workspace.num_splits >= num_splits and workspace.part_out.shape[3] == head_dim
    merge = num_splits > 1 and merge_in_split()
    _launch_split(query, k_cache, v_cache, out, workspace, query_start_loc, seq_lens, block_tables,
                  scale, num_splits, k_scale, v_scale, merge)
    if num_splits > 1 and not merge:
        _launch_merge(out, workspace, query_start_loc, num_seqs, num_splits)
    return out


def _default_splits(query, num_seqs, num_kv_heads, max_seq_len, k_cache, block_tables) -> int:
    if max_seq_len is None:  # upper bound from the block table width (no device sync)
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    num_sms = num_sms_of(query.device)
    return choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)


def _launch_split(query, k_cache, v_cache, out, ws, query_start_loc, seq_lens, block_tables,
                  scale, num_splits, k_scale=None, v_scale=None, merge: bool = False) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    cfg = decode_config(group, head_dim, query.element_size() if fp8 else k_cache.element_size())
    k_scale, v_scale = kv_scale_args(fp8, k_scale, v_scale, k_cache)
    one = num_splits == 1
    # with one split the scratch is unused: pass `out` in its place (never written)
    p_out = out if ws is None else ws.part_out
    p_lse = out if ws is None else ws.part_lse
    p_out_strides = (0, 0, 0, 0) if ws is None else ws.part_out.stride()
    p_lse_strides = (0, 0, 0) if ws is None else ws.part_lse.stride()
    grid = (seq_lens.shape[0], num_kv_heads, num_splits)
    counters = tile_counters(query.device, grid[0] * grid[1]) if merge else out  # (unused without MERGE)
    _decode_split_kernel[grid](
        query, k_cache, v_cache, out, p_out, p_lse, query_start_loc, seq_lens, block_tables, counters,
        num_splits, scale * LOG2E, k_scale, v_scale,
        *query.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        *p_out_strides, *p_lse_strides,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        MIN_CHUNK_N=triton.cdiv(MIN_CHUNK, cfg["BLOCK_N"]) * cfg["BLOCK_N"],
        NUM_SPLITS_IS_ONE=one, KV_FP8=fp8,
        IEEE=k_cache.dtype == torch.float32, WIDEN_F16=fp8_widen_f16(query), MERGE=merge,
        S_PAD=max(2, triton.next_power_of_2(num_splits)), SKIP_EMPTY=(merge or one) and skip_empty_enabled(),
        **cfg, **pdl_args(query),
    )


def _launch_merge(out, ws: DecodeWorkspace, query_start_loc, num_seqs: int, num_splits: int) -> None:
    num_heads, head_dim = out.shape[1:]
    _decode_merge_kernel[(num_seqs, num_heads)](
        out, ws.part_out, ws.part_lse, query_start_loc, num_splits,
        *out.stride(), *ws.part_out.stride(), *ws.part_lse.stride(),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        S_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4 if head_dim >= 128 else 2, **pdl_args(out),
    )

