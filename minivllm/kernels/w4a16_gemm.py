"""Triton W4A16 GEMM: y = x @ W.T with W in 4-bit groups, dequantized in registers.

Weights in the engine's layout (quant/w4.py): qweight [K/8, N] int32, nibble p of word [r, n] =
q[8r + ENGINE_ORDER[p], n] (rows interleaved 0, 2, 4, 6, 1, 3, 5, 7: `_nibble_row`); scales and
zeros [K/G, N]; an act-order permutation is applied to x (x[:, perm]).

    grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)

A program owns a BLOCK_M x BLOCK_N output tile and a share of K. Per BLOCK_K slice it unpacks the
packed words into one [BLOCK_K, BLOCK_N] tile in natural K order (`_unpack_tile`: row 8r + i sits
in nibble (i % 2) * 4 + i // 2 of word r), dequantizes it, (q - z) * s in float32 rounded once to
x's dtype (the reference's bits), and multiplies it with the contiguous [BLOCK_M, BLOCK_K]
activation tile in one tensor-core tl.dot. Until 2026-11-28 it ran 8 tl.dot of depth BLOCK_K/8 on
stride-8 activation columns, one per nibble: W11-awq's 128-token prefill took 61 ms on an H200,
against 10.9 ms now and vLLM's 12.7 (docs/perf.md, leases 43-45).

One or two rows (batch-1 decode) take `_w4a16_gemv_kernel` instead (BLOCK_M 1 in the configs):
elementwise products, no tensor cores. Decode is bound by the weight reads: SPLIT_K > 1 cuts K so
that enough programs stream the weights. Prefill steps of DENSE_MIN_ROWS rows or more dequantize
the weight once into the activation dtype (`_dequant_kernel`) and run cuBLAS: then the weight is
read once for thousands of rows. Fewer rows do the same where the kept several-row sweep timed it
faster than the kernel (`dense_beats_kernel`).

Split-K: every program's partial goes through kernels/split_k.py's fix-up (`store_tile`): the
tile's last program adds the partials in a fixed order and stores the result, in the same launch.

Nibble dequant without int -> float conversion (I2F runs at a fraction of the FMA rate on Hopper,
and there is one per weight): q | 0x4B000000 read as float32 is 2^23 + q exactly (0x4B000000 is
2^23, whose mantissa ulp is 1), so (f - (2^23 + z)) * s is one FADD and one FMUL; 2^23 + z is formed
once per loaded zero tile. Zero points are integers 0..15 (quant/w4.py), so both sums are exact
and f - zb = q - z exactly: the same bits as (q.to(float32) - z) * s.

Tile configs: `W4A16_CONFIGS`; for one or two rows, the kept per-weight launch of the GEMV when
this GPU has one (`gemv_launch`, from scripts/bench_w4a16_gemv.py --tiles / --write-from); for
more rows, the kept per-weight, per-row-count launch (`tiled_launch`, from
scripts/sweep_w4a16_tiled.py --write). The reference is
quant/w4.py: w4a16_reference.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.device import num_sms as num_sms_of
from minivllm.kernels.pdl import enter_after_previous, pdl_args, prefetch_l2
from minivllm.kernels.split_k import split_buffers, split_count, store_tile
from minivllm.kernels.tuned_tables import device_table
from minivllm.quant.w4 import interleave_scale_zero

# at this many rows and more: dequantize once, then a dense matmul (cuBLAS)
DENSE_MIN_ROWS = 256
# (max rows) -> tile config; the first entry whose bound is >= M is used where no kept table entry
# (tiled_launch, gemv_launch) applies. Split-K is chosen at run time from the number of output tiles
# (choose_split_k). BLOCK_M 1: the GEMV kernel (one row per program, no tensor cores). The
# several-row tiles are lease 44-45's H200 sweep winners (scripts/sweep_w4a16_tiled.py: BLOCK_M 32
# and BLOCK_K 64 at 32 rows on every weight; BLOCK_M 64-128 at 128 rows).
W4A16_CONFIGS: list[tuple[int, dict[str, int]]] = [
    (2, {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}),
    (16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
    (32, {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
    (64, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}),
    (1 << 30, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
]
MAX_SPLIT_K = 16
# the GEMV's packed half2 path for 16-bit activations (_word_dot_half2), on unless
# MINIVLLM_W4A16_GEMV_HALF2=0; never on the CPU (Triton's interpreter has no inline assembly).
# Lease 17 (H100, scripts/bench_w4a16_gemv.py --fp16, Llama-3.1-8B's four linears x 32 layers
# in CUDA graphs): 2.08 ms a token against 2.81 for the plain path and 2.51 for a zero-folding
# variant (removed)
GEMV_HALF2 = os.environ.get("MINIVLLM_W4A16_GEMV_HALF2", "1") != "0"
# the GEMV's pipelined K loop (PIPE in _w4a16_gemv_kernel), on by default since lease 27 (W11-awq
# 3.78 -> 3.62 ms a token, two A/B pairs); MINIVLLM_W4A16_GEMV_PIPE=0 turns it off (job ours:W11-awq-nopipe)
GEMV_PIPE = os.environ.get("MINIVLLM_W4A16_GEMV_PIPE", "1") != "0"
# the packed path's activation pairs as one 32-bit load each (XPAIR in _w4a16_gemv_kernel), where x's
# rows are contiguous at even offsets; MINIVLLM_W4A16_GEMV_XPAIR=0 forms them in registers as before
# (A/B runs: job ours:W11-awq-noxpair)
GEMV_XPAIR = os.environ.get("MINIVLLM_W4A16_GEMV_XPAIR", "1") != "0"
# the GEMV reads each column's scale and zero as one 32-bit word (SZ_PAIRS in _w4a16_gemv_kernel)
# where they are the halves of one tensor (quant/w4.py: interleave_scale_zero, as the loader stores
# them on a GPU); MINIVLLM_W4A16_GEMV_SZ_PAIRS=0 reads them as two tiles (job ours:W11-awq-nopairs).
# Lease 49's probe (docs/perf.md): the two tiles cost a layer's four GEMVs 10.7 us of 51 for 6 % of
# the bytes; lease 50's: read as pairs, 4.7 us of that goes (the reads alone, 43.8 -> 39.2 us)
GEMV_SZ_PAIRS = os.environ.get("MINIVLLM_W4A16_GEMV_SZ_PAIRS", "1") != "0"
# split K until about this many programs per SM. 4, from scripts/bench_w4a16_gemv.py on an H100
# (lease 7, Llama-3.1-8B batch-1 shapes, in CUDA graphs): at 2, gate_up (448 tiles) ran unsplit
# in 48.8 us against 41.9 us at split 2; the four linears of a layer take 88 us at 4, 95 us at 2
PROGRAMS_PER_SM = 4
# the GEMV's tile and split-K per weight on a GPU model: the kept sweep of scripts/bench_w4a16_gemv.py
# --tiles (its --write-from), kernels/configs/w4a16_gemv/<GPU>.json, "N=..,K=..,G=.." ->
# {"tile": [BLOCK_N, BLOCK_K, num_warps, num_stages], "split_k": s}. Weights without an entry keep
# W4A16_CONFIGS' tile and choose_split_k's split; MINIVLLM_W4A16_GEMV_TABLE=0 keeps them for all
# (A/B runs: job ours:W11-awq-notable)
GEMV_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "w4a16_gemv")
GEMV_TABLE = os.environ.get("MINIVLLM_W4A16_GEMV_TABLE", "1") != "0"
# the several-row kernel's launch per weight and row count on a GPU model: the kept sweep of
# scripts/sweep_w4a16_tiled.py --write, kernels/configs/w4a16_tiled/<GPU>.json, "N=..,K=..,G=.." ->
# {"rows": [[max_rows, config, split_k, us, dense_us], ...]}: the first entry whose max_rows >= M
# (M above the last: the last). Weights without an entry keep W4A16_CONFIGS and choose_split_k.
# below DENSE_MIN_ROWS, dequant + cuBLAS for a weight and row count where the kept several-row sweep
# timed it faster than the kernel (dense_beats_kernel; lease 45, H200, 128 rows: qkv 39.5 against
# 48.7 us, o 30.9 against 33.3); MINIVLLM_W4A16_DENSE_CHOICE=0 keeps the kernel (job ours:W11-awq-nodense)
DENSE_CHOICE = os.environ.get("MINIVLLM_W4A16_DENSE_CHOICE", "1") != "0"
TILED_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "w4a16_tiled")
# the float32 bits of 2^23 (ulp 1): OR-ing a nibble q into them gives the float 2^23 + q exactly
MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)
MAGIC: tl.constexpr = tl.constexpr(8388608.0)  # 2^23


@triton.jit
def _nibble(w, j: tl.constexpr):
    """Nibble j of each int32 word as the float32 2^23 + q, exactly, without an I2F: the
    nibble OR-ed into the mantissa of 2^23 and the bits read as a float."""
    return (((w >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_row(p: tl.constexpr):
    """The row (0..7) of its word's 8 that nibble p holds: quant/w4.py's ENGINE_ORDER (0, 2, 4, 6,
    1, 3, 5, 7), so that nibbles p and p + 4 hold the adjacent rows 2p and 2p + 1."""
    return (p % 4) * 2 + p // 4


# One int32 word of 8 nibbles (nibble p at bits 4p holds row 2p for p < 4, row 2(p - 4) + 1 above:
# _nibble_row) against its 8 activations, in packed 16-bit math:
#   lop3 (w >> 4p) & 0x000F000F | MAGIC  ->  the pair (MAGIC + q_2p / 16, MAGIC + q_2p+1 / 16), exactly
#   sub  the pair (MAGIC + z / 16) x 2    ->  ((q_2p - z) / 16, (q_2p+1 - z) / 16), exactly
#   fma  with the activation pair (x_2p, x_2p+1) into a packed accumulator (4 pairs)
# then the two halves widened to float32 and added: $0 = sum_j (q_j - z) x_j / 16. MAGIC has an
# ulp of 1/16: 64 in float16 (0x5400, ulp 2^-4 on [64, 128)) and 8 in bfloat16 (0x4100, ulp 2^-4 on
# [8, 16)), so a nibble OR-ed into its mantissa is q / 16. The activation pair is x's two adjacent
# 16-bit values, one 32-bit load (XPAIR); without XPAIR the kernel forms it as (x / 16, x / 16) in
# registers and MAGIC is 1024 / 128 (ulp 1): the same products, (q - z) (x / 16).
# Per 8 weights: 3 shifts, 4 LOP3, 4 packed subs, 4 packed FMAs, 2 widenings, an add (the plain
# path: a shift, a LOP3, FADD, FMUL and FFMA per weight). The 1/16 keeps the packed partial
# inside float16's range (|q - z| <= 15, so |partial| <= 4 max|x|); the kernel multiplies the 16
# back once, into the reduced output.
_HALF2_ASM = """{{
.reg .b32 w4t, w4a, w4b, w4c, w4d, w4acc;
.reg .{rty} w4lo, w4hi;
.reg .f32 w4flo, w4fhi;
lop3.b32 w4a, $1, 0x000f000f, {magic}, 0xea;
shr.u32 w4t, $1, 4;
lop3.b32 w4b, w4t, 0x000f000f, {magic}, 0xea;
shr.u32 w4t, $1, 8;
lop3.b32 w4c, w4t, 0x000f000f, {magic}, 0xea;
shr.u32 w4t, $1, 12;
lop3.b32 w4d, w4t, 0x000f000f, {magic}, 0xea;
sub{rnd}.{ty}x2 w4a, w4a, $2;
sub{rnd}.{ty}x2 w4b, w4b, $2;
sub{rnd}.{ty}x2 w4c, w4c, $2;
sub{rnd}.{ty}x2 w4d, w4d, $2;
mul{rnd}.{ty}x2 w4acc, w4a, $3;
fma.rn.{ty}x2 w4acc, w4b, $4, w4acc;
fma.rn.{ty}x2 w4acc, w4c, $5, w4acc;
fma.rn.{ty}x2 w4acc, w4d, $6, w4acc;
mov.b32 {{w4lo, w4hi}}, w4acc;
cvt.f32.{ty} w4flo, w4lo;
cvt.f32.{ty} w4fhi, w4hi;
add.f32 $0, w4flo, w4fhi;
}}"""
# the 16-bit MAGIC bits of the formed pairs (ulp 1); XPAIR's (ulp 1/16) are 64.0 and 8.0 (_zero_bits)
MAGIC16_F16_UNIT: tl.constexpr = tl.constexpr(0x6400)  # 1024.0
MAGIC16_BF16_UNIT: tl.constexpr = tl.constexpr(0x4300)  # 128.0
HALF2_ASM_F16: tl.constexpr = tl.constexpr(_HALF2_ASM.format(magic="0x54005400", ty="f16", rty="f16", rnd=".rn"))
HALF2_ASM_BF16: tl.constexpr = tl.constexpr(_HALF2_ASM.format(magic="0x41004100", ty="bf16", rty="b16", rnd=".rn"))
HALF2_ASM_F16_UNIT: tl.constexpr = tl.constexpr(_HALF2_ASM.format(magic="0x64006400", ty="f16", rty="f16", rnd=".rn"))
HALF2_ASM_BF16_UNIT: tl.constexpr = tl.constexpr(_HALF2_ASM.format(magic="0x43004300", ty="bf16", rty="b16", rnd=".rn"))


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr, CG: tl.constexpr):
    """tl.load, masked (0 outside) unless EVEN says the tile lies wholly inside the tensor; CG:
    through L2 only (.cg). (Every argument is passed: Triton 3.6 does not wrap a helper's default
    constexpr string.)"""
    if EVEN:
        if CG:
            return tl.load(ptrs, cache_modifier=".cg")
        return tl.load(ptrs)
    if CG:
        return tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _load_scale_zero(s_ptr, z_ptr, grp, rn, stride_sg, stride_sn, mask, EVEN: tl.constexpr, CG: tl.constexpr,
                     PAIRS: tl.constexpr):
    """The [len(grp), len(rn)] scale and zero tiles of groups grp and columns rn, in their own
    dtype (as _load). PAIRS: each 16-bit scale and its zero are the low and high halves of one
    aligned 32-bit word (quant/w4.py: interleave_scale_zero; the host checks z_ptr = s_ptr + 1 and
    stride_sn = 2, so word [g, n] sits at g * stride_sg / 2 + n, unit-stride along the columns as
    the words): one load, split in registers, the same values."""
    if PAIRS:
        dt = s_ptr.dtype.element_ty
        pair = _load(s_ptr.to(tl.pointer_type(tl.int32)) + grp[:, None] * (stride_sg // 2) + rn[None, :], mask,
                     EVEN, CG)
        return pair.to(tl.int16).to(dt, bitcast=True), (pair >> 16).to(tl.int16).to(dt, bitcast=True)
    g_off = grp[:, None] * stride_sg + rn[None, :] * stride_sn
    return _load(s_ptr + g_off, mask, EVEN, CG), _load(z_ptr + g_off, mask, EVEN, CG)


@triton.jit
def _x_pair_bits(x_ptr, m, stride_xm, stride_xk, words, p: tl.constexpr, K, EVEN: tl.constexpr,
                 XPAIR: tl.constexpr):
    """[BK/8] int32: the activations of rows 2p and 2p + 1 of each word r, x[8r + 2p] and
    x[8r + 2p + 1], packed as two 16-bit floats (low half first), for _word_dot_half2's pair p.
    XPAIR: they are adjacent in x, so the pair is one 32-bit load (the host checks that x's rows
    are contiguous at even offsets). Else formed in registers, each divided by 16 (for the ulp-1
    MAGIC)."""
    if XPAIR:
        x_words = x_ptr.to(tl.pointer_type(tl.int32)) + m * (stride_xm // 2)
        return _load(x_words + words * 4 + p, words < K // 8, EVEN, False)
    k0 = words * 8 + 2 * p
    row_off = m * stride_xm
    lo = _load(x_ptr + row_off + k0 * stride_xk, k0 < K, EVEN, False).to(tl.float32) * 0.0625
    hi = _load(x_ptr + row_off + (k0 + 1) * stride_xk, k0 + 1 < K, EVEN, False).to(tl.float32) * 0.0625
    dt = x_ptr.dtype.element_ty
    lo_bits = lo.to(dt).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(dt).to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def _zero_bits(z, BF16: tl.constexpr, XPAIR: tl.constexpr):
    """Zero points (integers 0..15, any float dtype) -> int32: the 16-bit float MAGIC + z / 16
    (XPAIR's MAGIC, ulp 1/16) or MAGIC + z (ulp 1) of the activations' type, in both halves."""
    if XPAIR:
        if BF16:
            if z.dtype == tl.bfloat16:  # exact in the zeros' own type: one FMA
                zf = z * 0.0625 + 8.0
            else:
                zf = (z.to(tl.float32) * 0.0625 + 8.0).to(tl.bfloat16)
        else:
            if z.dtype == tl.float16:
                zf = z * 0.0625 + 64.0
            else:
                zf = (z.to(tl.float32) * 0.0625 + 64.0).to(tl.float16)
        zi = zf.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        if BF16:
            zi = z.to(tl.int32) + MAGIC16_BF16_UNIT
        else:
            zi = z.to(tl.int32) + MAGIC16_F16_UNIT
    return zi | (zi << 16)


@triton.jit
def _word_dot_half2(w, z, x0, x1, x2, x3, ROWS: tl.constexpr, COLS: tl.constexpr, BF16: tl.constexpr,
                    XPAIR: tl.constexpr):
    """w [ROWS, COLS] int32 words, z [ROWS, COLS] float zero points (integers 0..15), x0..x3 [ROWS]
    activation pairs (_x_pair_bits) -> [ROWS, COLS] float32: sum_j (q_j - z) x_j / 16 per word."""
    z2 = _zero_bits(z, BF16, XPAIR)
    xb0 = tl.broadcast_to(x0[:, None], (ROWS, COLS))
    xb1 = tl.broadcast_to(x1[:, None], (ROWS, COLS))
    xb2 = tl.broadcast_to(x2[:, None], (ROWS, COLS))
    xb3 = tl.broadcast_to(x3[:, None], (ROWS, COLS))
    args = [w, z2, xb0, xb1, xb2, xb3]
    if XPAIR:
        if BF16:
            part = tl.inline_asm_elementwise(HALF2_ASM_BF16, "=f,r,r,r,r,r,r", args, dtype=tl.float32, is_pure=True,
                                             pack=1)
        else:
            part = tl.inline_asm_elementwise(HALF2_ASM_F16, "=f,r,r,r,r,r,r", args, dtype=tl.float32, is_pure=True,
                                             pack=1)
    else:
        if BF16:
            part = tl.inline_asm_elementwise(HALF2_ASM_BF16_UNIT, "=f,r,r,r,r,r,r", args, dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            part = tl.inline_asm_elementwise(HALF2_ASM_F16_UNIT, "=f,r,r,r,r,r,r", args, dtype=tl.float32,
                                             is_pure=True, pack=1)
    return part


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # [K/8, N] int32
    s_ptr, z_ptr,  # [K/G, N] scales, zeros
    out_ptr,  # [M, N] in x's dtype
    ws_ptr,  # SPLIT_K > 1: [SPLIT_K, M, N] float32 partials (contiguous); else unused
    cnt_ptr,  # SPLIT_K > 1: int32 counters, one per output tile, 0 on entry and on exit; else unused
    M, N, K,
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_om, stride_on,
    GROUP: tl.constexpr,  # input features per group (a multiple of 8)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Several rows (prefill, batched decode): per BLOCK_K step the packed words are unpacked
    into one [BLOCK_K, BLOCK_N] tile of x's dtype, rows in natural K order, and multiplied with
    the contiguous [BLOCK_M, BLOCK_K] activation tile in one tl.dot (tensor cores, depth
    BLOCK_K). The dequantized values are the reference's bits: (q - z) * s in float32, rounded
    once to x's dtype."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_end = tl.minimum((pid_k + 1) * per_split, k_tiles)
    for t in range(pid_k * per_split, t_end):
        k = t * BLOCK_K + rk  # [BK] input features of this step, natural order
        k_ok = k < K
        q = _unpack_tile(qw_ptr, t, rn, n_ok, K, stride_qk, stride_qn, BLOCK_N, BLOCK_K)  # [BK, BN] 2^23 + q
        if GROUP % BLOCK_K == 0:  # the step lies in one group: one scale and zero row
            g_off = ((t * BLOCK_K) // GROUP) * stride_sg + rn * stride_sn
            s = tl.load(s_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            zb = tl.load(z_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)[None, :] + MAGIC
        else:  # several groups a step: a row of each feature's group (cache hits)
            g_off = (k // GROUP)[:, None] * stride_sg + rn[None, :] * stride_sn
            g_ok = k_ok[:, None] & n_ok[None, :]
            s = tl.load(s_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32)
            zb = tl.load(z_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32) + MAGIC
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = ((q - zb) * s).to(xt.dtype)  # q - z exactly (2^23 + q - (2^23 + z)), then the reference's rounding
        acc += tl.dot(xt, w)
    store_tile(acc, out_ptr, ws_ptr, cnt_ptr, rm[:, None] * stride_om + rn[None, :] * stride_on,
               rm[:, None] * N + rn[None, :], M * N, m_ok[:, None] & n_ok[None, :], pid_k,
               pid_m * tl.num_programs(0) + pid_n, SPLIT_K)


@triton.jit
def _unpack_tile(qw_ptr, t, rn, n_ok, K, stride_qk, stride_qn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step t's [BLOCK_K, BLOCK_N] weights as float32 2^23 + q, row i = input feature
    t * BLOCK_K + i: the [BLOCK_K/8, BLOCK_N] words loaded once, shifted into [BLOCK_K/8, 8,
    BLOCK_N] and reshaped. Row 8r + i of a word's eight sits in nibble (i % 2) * 4 + i // 2 (the
    inverse of _nibble_row). (Loading each word once per row it holds instead, eight loads a
    word, was 4-10x slower on every weight at 32 and 128 rows: H200, leases 44-45.)"""
    rw = t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    w = tl.load(qw_ptr + rw[:, None] * stride_qk + rn[None, :] * stride_qn,
                mask=(rw < K // 8)[:, None] & n_ok[None, :], other=0)  # [BK/8, BN]
    i = tl.arange(0, 8)
    shift = 4 * ((i % 2) * 4 + i // 2)  # [8]
    q = tl.reshape((w[:, None, :] >> shift[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
    return (q | MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,  # as _w4a16_kernel; one activation row per program
    M, N, K,
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_om, stride_on,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HALF2: tl.constexpr = False,
    EVEN: tl.constexpr = False,  # K % BLOCK_K == 0 and N % BLOCK_N == 0: the weight tiles need no masks
    PREFETCH_WORDS: tl.constexpr = 32,  # packed rows of the slice requested into L2 before the PDL wait
    COL_STEP: tl.constexpr = 32,  # columns a 128-byte line of packed words holds (BLOCK_N if fewer)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    PIPE: tl.constexpr = False,  # next K step's words, scales and zeros loaded before this one's math
    XPAIR: tl.constexpr = False,  # HALF2's activation pairs loaded as 32-bit words (x's rows contiguous, even offsets)
    SZ_PAIRS: tl.constexpr = False,  # each scale and zero read as one 32-bit word (_load_scale_zero)
):
    """Few rows (batch-1 decode): no tensor cores, so the dequantized tile never changes layout
    for a tl.dot operand; products accumulate elementwise in a [BLOCK_K/8, BLOCK_N] tile and are
    reduced once at the end. The weights are re-read per row (from L2 for a few rows).

    HALF2 (16-bit activations, the default there): each word's 8 products in packed 16-bit math
    (_word_dot_half2): 3.8 instructions a weight in the K loop against 7.0 for the plain path (a
    shift, a LOP3, FADD, FMUL and FFMA a weight, plus the conversions), which issue-bound the
    kernel at 0.9-1.5 TB/s of int4.

    PDL (kernels/pdl.py): the slice's first PREFETCH_WORDS packed rows are requested into L2
    before waiting for the kernel that writes x (the weights stream while it finishes).

    XPAIR (the default for HALF2 where x's rows allow it; MINIVLLM_W4A16_GEMV_XPAIR=0 off): a word's
    nibbles p and p + 4 hold adjacent rows (quant/w4.py's ENGINE_ORDER), so each of its four
    activation pairs is one 32-bit load of x instead of two loads, two scalings and a repack
    formed per word row by every thread that holds it: 4.5 -> 3.5 SASS instructions a weight in
    the K loop (BLOCK_N 32; tests/unit/test_w4a16_half2_compile.py counts them).

    PIPE (the default; MINIVLLM_W4A16_GEMV_PIPE=0 off): the loop loads K step t + 1's words,
    scales and zeros before it computes step t, and the first step's before the PDL wait (weights:
    no kernel writes them), as the streaming dense GEMV does (kernels/dense_gemv.py); two steps
    of weight loads in flight per thread instead of one."""
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_K // 8)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_end = tl.minimum((pid_k + 1) * per_split, k_tiles)
    if PDL and not PIPE:  # (PIPE loads the first step itself before the wait)
        pw = tl.minimum(pid_k * per_split * (BLOCK_K // 8) + tl.arange(0, PREFETCH_WORDS), t_end * (BLOCK_K // 8) - 1)
        pc = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N // COL_STEP) * COL_STEP, N - 1)
        prefetch_l2(qw_ptr + pw[:, None] * stride_qk + pc[None, :] * stride_qn)
    if PIPE:
        acc = _w4a16_gemv_pipelined(acc, x_ptr, qw_ptr, s_ptr, z_ptr, m, rn, rw, n_ok, K, pid_k * per_split, t_end,
                                    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                                    GROUP, BLOCK_N, BLOCK_K, HALF2, EVEN, PDL, XPAIR, SZ_PAIRS)
    else:
        acc = _w4a16_gemv_steps(acc, x_ptr, qw_ptr, s_ptr, z_ptr, m, rn, rw, n_ok, K, pid_k * per_split, t_end,
                                stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                                GROUP, BLOCK_N, BLOCK_K, HALF2, EVEN, PDL, XPAIR, SZ_PAIRS)
    out = tl.sum(acc, 0)  # [BLOCK_N]
    if HALF2:
        out = out * 16.0  # the activations entered the packed products divided by 16 (exact)
    store_tile(out, out_ptr, ws_ptr, cnt_ptr, m * stride_om + rn * stride_on, m * N + rn, M * N, n_ok, pid_k,
               m * tl.num_programs(0) + pid_n, SPLIT_K)


@triton.jit
def _w4a16_gemv_steps(acc, x_ptr, qw_ptr, s_ptr, z_ptr, m, rn, rw, n_ok, K, t_begin, t_end,
                      stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF2: tl.constexpr,
                      EVEN: tl.constexpr, PDL: tl.constexpr, XPAIR: tl.constexpr, SZ_PAIRS: tl.constexpr):
    """The GEMV's K loop over steps t_begin .. t_end - 1, each step's loads then its math."""
    enter_after_previous(PDL)
    for t in range(t_begin, t_end):
        words = t * (BLOCK_K // 8) + rw
        w_ok = (words < K // 8)[:, None] & n_ok[None, :]
        w_ptrs = qw_ptr + words[:, None] * stride_qk + rn[None, :] * stride_qn
        w = _load(w_ptrs, w_ok, EVEN, False)
        s, z = _load_scale_zero(s_ptr, z_ptr, (words * 8) // GROUP, rn, stride_sg, stride_sn, w_ok, EVEN, False,
                                SZ_PAIRS)
        s = s.to(tl.float32)
        if HALF2:  # 16-bit activations: packed math per word (_word_dot_half2); the 16 once, at the end
            acc += _half2_step(w, z, x_ptr, m, words, K, stride_xm, stride_xk, BLOCK_N, BLOCK_K, EVEN, XPAIR) * s
        else:
            zb = z.to(tl.float32) + MAGIC  # 2^23 + z, exact
            acc = _plain_step(acc, w, zb, s, x_ptr, m, words, K, stride_xm, stride_xk)
    return acc


@triton.jit
def _half2_step(w, z, x_ptr, m, words, K, stride_xm, stride_xk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN: tl.constexpr, XPAIR: tl.constexpr):
    """[BLOCK_K/8, BLOCK_N] float32: each word's sum_j (q_j - z) x[8r + j] / 16 (_word_dot_half2)."""
    return _word_dot_half2(w, z, _x_pair_bits(x_ptr, m, stride_xm, stride_xk, words, 0, K, EVEN, XPAIR),
                           _x_pair_bits(x_ptr, m, stride_xm, stride_xk, words, 1, K, EVEN, XPAIR),
                           _x_pair_bits(x_ptr, m, stride_xm, stride_xk, words, 2, K, EVEN, XPAIR),
                           _x_pair_bits(x_ptr, m, stride_xm, stride_xk, words, 3, K, EVEN, XPAIR),
                           BLOCK_K // 8, BLOCK_N, x_ptr.dtype.element_ty == tl.bfloat16, XPAIR)


@triton.jit
def _plain_step(acc, w, zb, s, x_ptr, m, words, K, stride_xm, stride_xk):
    """acc += x[8r + row(j)] * (q - z) * s for the 8 nibbles j of every word r (float32)."""
    for j in tl.static_range(8):
        k = words * 8 + _nibble_row(j)
        xj = tl.load(x_ptr + m * stride_xm + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)  # [BK/8]
        acc += xj[:, None] * ((_nibble(w, j) - zb) * s)
    return acc


@triton.jit
def _w4_step_operands(qw_ptr, s_ptr, z_ptr, rn, rw, n_ok, K, t, t_end, stride_qk, stride_qn, stride_sg, stride_sn,
                      GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SZ_PAIRS: tl.constexpr):
    """K step t's packed words, scales and zeros ([BLOCK_K/8, BLOCK_N] each, raw dtypes), read
    through L2 (.cg: read once a step, and the PTX check of the PDL contract tells them from x's
    loads; SZ_PAIRS: _load_scale_zero); nothing is read for t >= t_end, unless EVEN:
    then the loads take no masks and step t_end - 1 is read again instead (an L2 hit; a slice with
    no steps reads the weight's last one)."""
    if EVEN:
        t = tl.minimum(t, t_end - 1)
    words = t * (BLOCK_K // 8) + rw
    w_ptrs = qw_ptr + words[:, None] * stride_qk + rn[None, :] * stride_qn
    ok = (words < tl.where(t < t_end, K // 8, 0))[:, None] & n_ok[None, :]  # (unused when EVEN)
    # the words' loads issued before the scales' and zeros': with them after, W11-awq's token took
    # 3.13 ms instead of 2.74 (two tiles) and 2.91 instead of 2.60 (pairs), H200, leases 51-54;
    # the kernel timed alone (probe_gemv_read.py, bench_w4a16_gemv.py --sequence) showed neither
    w = _load(w_ptrs, ok, EVEN, True)
    s, z = _load_scale_zero(s_ptr, z_ptr, (words * 8) // GROUP, rn, stride_sg, stride_sn, ok, EVEN, True, SZ_PAIRS)
    return w, s, z


@triton.jit
def _w4a16_gemv_pipelined(acc, x_ptr, qw_ptr, s_ptr, z_ptr, m, rn, rw, n_ok, K, t_begin, t_end,
                          stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF2: tl.constexpr,
                          EVEN: tl.constexpr, PDL: tl.constexpr, XPAIR: tl.constexpr, SZ_PAIRS: tl.constexpr):
    """The GEMV's K loop with step t + 1's weight loads issued before step t's math; the first
    step's before the PDL wait."""
    w, s, z = _w4_step_operands(qw_ptr, s_ptr, z_ptr, rn, rw, n_ok, K, t_begin, t_end, stride_qk, stride_qn,
                                stride_sg, stride_sn, GROUP, BLOCK_K, EVEN, SZ_PAIRS)
    enter_after_previous(PDL)
    for t in range(t_begin, t_end):
        w_n, s_n, z_n = _w4_step_operands(qw_ptr, s_ptr, z_ptr, rn, rw, n_ok, K, t + 1, t_end, stride_qk,
                                          stride_qn, stride_sg, stride_sn, GROUP, BLOCK_K, EVEN, SZ_PAIRS)
        words = t * (BLOCK_K // 8) + rw
        if HALF2:
            acc += _half2_step(w, z, x_ptr, m, words, K, stride_xm, stride_xk, BLOCK_N, BLOCK_K, EVEN,
                               XPAIR) * s.to(tl.float32)
        else:
            acc = _plain_step(acc, w, z.to(tl.float32) + MAGIC, s.to(tl.float32), x_ptr, m, words, K,
                              stride_xm, stride_xk)
        w, s, z = w_n, s_n, z_n
    return acc


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr,  # as above
    w_ptr,  # [K, N] out, rows in qweight's (stored) order
    K, N,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_wk, stride_wn,
    GROUP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    words = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (words < K // 8)[:, None] & (rn < N)[None, :]
    w = tl.load(qw_ptr + words[:, None] * stride_qk + rn[None, :] * stride_qn, mask=ok, other=0)
    g_off = ((words * 8) // GROUP)[:, None] * stride_sg + rn[None, :] * stride_sn
    s = tl.load(s_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
    zb = tl.load(z_ptr + g_off, mask=ok, other=0.0).to(tl.float32) + MAGIC  # 2^23 + z, exact
    for j in tl.static_range(8):
        wj = (_nibble(w, j) - zb) * s
        k = words * 8 + _nibble_row(j)
        tl.store(w_ptr + k[:, None] * stride_wk + rn[None, :] * stride_wn, wj.to(w_ptr.dtype.element_ty), mask=ok)


def w4a16_config(m: int) -> dict[str, int]:
    return next(cfg for bound, cfg in W4A16_CONFIGS if m <= bound)


GEMV_TILE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")  # a kept entry's "tile", in order


def gemv_key(n: int, k: int, group: int) -> str:
    return f"N={n},K={k},G={group}"


@functools.lru_cache(maxsize=None)
def gemv_table(device_name: str) -> dict:
    """The kept GEMV sweep for this GPU model or its sibling's (tuned_tables.device_table; {} when
    none was kept)."""
    return device_table(GEMV_CONFIG_DIR, device_name)


def gemv_entry_launch(entry: dict | None) -> tuple[dict[str, int], int | None]:
    """(config, split_k) a kept entry gives the GEMV: W4A16_CONFIGS' tile and None (choose_split_k
    decides) without one."""
    cfg = dict(w4a16_config(1))
    if entry is None:
        return cfg, None
    cfg.update(zip(GEMV_TILE_KEYS, entry["tile"]))
    return cfg, entry["split_k"]


def _kept_entry(table_of, n: int, k: int, group: int, device: torch.device) -> dict | None:
    """This weight's entry in the kept table that table_of (device name -> table) gives a CUDA
    device; None on other devices, for weights without one, or with MINIVLLM_W4A16_GEMV_TABLE=0."""
    if not GEMV_TABLE or device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return table_of(torch.cuda.get_device_name(index)).get(gemv_key(n, k, group))


def gemv_launch(n: int, k: int, group: int, device: torch.device) -> tuple[dict[str, int], int | None]:
    """(config, split_k) of the batch-1 GEMV for this weight on this device: the kept table's
    entry on a GPU that has one (gemv_entry_launch)."""
    return gemv_entry_launch(_kept_entry(gemv_table, n, k, group, device))


@functools.lru_cache(maxsize=None)
def tiled_table(device_name: str) -> dict:
    """The kept several-row sweep for this GPU model or its sibling's ({} when none was kept)."""
    return device_table(TILED_CONFIG_DIR, device_name)


def _kept_row(m: int, n: int, k: int, group: int, device: torch.device) -> list | None:
    """The kept several-row entry for m rows of this weight, [max_rows, config, split_k, us,
    dense_us]: the nearest row count at or above m (above the last: the last); None without one."""
    rows = (_kept_entry(tiled_table, n, k, group, device) or {}).get("rows", [])
    return next((r for r in rows if r[0] >= m), rows[-1]) if rows else None


def tiled_launch(m: int, n: int, k: int, group: int, device: torch.device) -> tuple[dict, int | None]:
    """(config, split_k) of the several-row kernel for m rows of this weight: the kept entry of
    the nearest row count at or above m on a GPU that has one; else W4A16_CONFIGS' and None."""
    row = _kept_row(m, n, k, group, device)
    if row is None:
        return dict(w4a16_config(m)), None
    return dict(row[1]), row[2]


def dense_beats_kernel(m: int, n: int, k: int, group: int, device: torch.device) -> bool:
    """Whether m rows of this weight (below DENSE_MIN_ROWS) go through dequant + cuBLAS: the kept
    several-row sweep timed that faster than the kernel at the row count whose launch m uses, and m
    is above half that count (the kernel's time falls with fewer row tiles, dequantizing does
    not). Never without a kept table or with MINIVLLM_W4A16_DENSE_CHOICE=0."""
    row = _kept_row(m, n, k, group, device) if DENSE_CHOICE else None
    return row is not None and m > row[0] // 2 and row[4] < row[3]


def pairs_are_words(x: torch.Tensor) -> bool:
    """Whether x's activations pair up into aligned 32-bit words: 16-bit, unit stride along K, and
    every row starting at an even element of a 4-byte aligned buffer (the GEMV's XPAIR loads)."""
    return (x.element_size() == 2 and x.stride(1) == 1 and (x.shape[0] <= 1 or x.stride(0) % 2 == 0)
            and x.data_ptr() % 4 == 0)


def scale_zero_pairs(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether each 16-bit scale and its zero are the low and high halves of one aligned 32-bit
    word (quant/w4.py: interleave_scale_zero), as the GEMV's SZ_PAIRS reads them."""
    return (scales.element_size() == 2 and zeros.dtype == scales.dtype and zeros.stride() == scales.stride()
            and scales.stride(-1) == 2 and scales.stride(0) % 2 == 0 and scales.data_ptr() % 4 == 0
            and zeros.data_ptr() == scales.data_ptr() + 2)


def gemv_scale_zero_layout(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPU weight's scales and zeros as the GEMV reads them: interleaved into pairs
    (quant/w4.py: interleave_scale_zero) unless MINIVLLM_W4A16_GEMV_SZ_PAIRS=0 keeps the two
    tensors (GEMV_SZ_PAIRS). The loader and bench_w4a16_gemv.py store their weights through it."""
    return interleave_scale_zero(scales, zeros) if GEMV_SZ_PAIRS else (scales, zeros)


def choose_split_k(m: int, n: int, k: int, cfg: dict[str, int], num_sms: int) -> int:
    """Cut K until the grid has about PROGRAMS_PER_SM programs per SM for the GEMV, one for the
    several-row kernel, whose tensor-core tiles each keep an SM busy (a power of two, at most
    MAX_SPLIT_K and the number of K slices)."""
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
    per_sm = PROGRAMS_PER_SM if cfg["BLOCK_M"] == 1 else 1
    return split_count(tiles, triton.cdiv(k, cfg["BLOCK_K"]), num_sms, per_sm, MAX_SPLIT_K)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, split_k: int | None = None, config: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous or strided) -> [M, N] in x's dtype, through the Triton kernel:
    one launch, split-K or not (the partials are added in the kernel)."""
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * 8 == k and scales.shape == zeros.shape and scales.shape[1] == n, (x.shape, qweight.shape)
    g = k if group_size == -1 else group_size
    if config is None:  # the tuned launch for this weight and row count
        if m <= W4A16_CONFIGS[0][0]:
            cfg, kept_split = gemv_launch(n, k, g, x.device)
        else:
            cfg, kept_split = tiled_launch(m, n, k, g, x.device)
        split_k = kept_split if split_k is None else split_k
    else:
        cfg = dict(config)
    if split_k is None:
        split_k = choose_split_k(m, n, k, cfg, num_sms_of(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
    ws, cnt = split_buffers(split_k, m, n, grid[0] * grid[1], out)
    args = (x, qweight, scales, zeros, out, ws, cnt, m, n, k, *x.stride(), *qweight.stride(), *scales.stride(),
            *out.stride())
    if cfg["BLOCK_M"] == 1:
        del cfg["BLOCK_M"]
        cfg.setdefault("HALF2", GEMV_HALF2 and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16))
        cfg.setdefault("EVEN", k % cfg["BLOCK_K"] == 0 and n % cfg["BLOCK_N"] == 0)
        cfg.setdefault("COL_STEP", min(cfg["BLOCK_N"], 32))
        cfg.setdefault("PIPE", GEMV_PIPE)
        cfg.setdefault("XPAIR", cfg["HALF2"] and GEMV_XPAIR and pairs_are_words(x))
        cfg.setdefault("SZ_PAIRS", GEMV_SZ_PAIRS and scale_zero_pairs(scales, zeros))
        _w4a16_gemv_kernel[grid](*args, GROUP=g, SPLIT_K=split_k, **cfg, **pdl_args(x))
    else:
        _w4a16_kernel[grid](*args, GROUP=g, SPLIT_K=split_k, **cfg)
    return out


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """-> W^T [K, N] in `dtype`, rows in qweight's stored order (x[:, perm] @ it is the product)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_w, block_n = 16, 128
    grid = (triton.cdiv(k // 8, block_w), triton.cdiv(n, block_n))
    _dequant_kernel[grid](qweight, scales, zeros, w, k, n, *qweight.stride(), *scales.stride(), *w.stride(),
                          GROUP=k if group_size == -1 else group_size, BLOCK_W=block_w, BLOCK_N=block_n)
    return w


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the layer's product (QuantLinear on a GPU)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if perm is not None:
        rows = rows.index_select(1, perm)
    m, n = rows.shape[0], qweight.shape[1]
    if m >= DENSE_MIN_ROWS or (m > 2 and dense_beats_kernel(m, n, k, k if group_size == -1 else group_size,
                                                             x.device)):
        y = rows @ w4a16_dequantize(qweight, scales, zeros, group_size, x.dtype)
    else:
        y = w4a16_gemm(rows, qweight, scales, zeros, group_size)
    if bias is not None:
        y = y + bias
    return y.view(*lead, y.shape[-1])
