"""The quantization kernels against their plain-PyTorch references: the W4A16 GEMM (and its
dequant + dense path), the FP8 linear, and the attention kernels over an FP8 (e4m3) KV cache.

The check helpers are device-agnostic: tests/unit/test_quant_interpret.py runs them under
Triton's interpreter on the CPU with small shapes (fp32 / fp16; the interpreter's float -> fp8
rounding is not the hardware's, so there the FP8 caches are written by the reference and only
the kernels' reads are checked); the tests here run them on the GPU (bf16 too, FP8 stores).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the interpreter child loads this file by path
from test_triton_kernels import PagedCase, errors, make_case, random_specs  # noqa: E402

from minivllm.attention.reference import paged_attention_reference, store_kv_reference  # noqa: E402
from minivllm.quant import w4  # noqa: E402

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------- W4A16 (any device)


def w4_case(m: int, n: int, k: int, group: int, dtype, device, seed: int, act_order: bool = False,
            pairs: bool = False):
    """Random 4-bit weights in the engine's layout and activations x [m, k]; pairs: 16-bit scales
    and zeros interleaved as the GPU loader stores them (w4.interleave_scale_zero)."""
    g = torch.Generator().manual_seed(seed)
    ng = 1 if group == -1 else k // group
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(ng, n, generator=g) * 0.02 + 0.002).to(dtype)
    zeros = torch.randint(0, 16, (ng, n), generator=g).to(dtype)
    perm = torch.randperm(k, generator=g) if act_order else None
    x = torch.randn(m, k, generator=g).to(dtype)
    x, qw, scales, zeros, perm = [t.to(device) if t is not None else None
                                  for t in (x, w4.pack_engine(q), scales, zeros, perm)]
    if pairs:
        scales, zeros = w4.interleave_scale_zero(scales, zeros)
    return x, qw, scales, zeros, perm


def check_w4a16(m: int, n: int, k: int, group: int, dtype, device, seed: int = 0, split_k: int | None = None,
                config: dict | None = None, act_order: bool = False, pairs: bool = False) -> float:
    """Relative error of w4a16_linear (or w4a16_gemm with split_k/config) against the reference."""
    from minivllm.kernels.w4a16_gemm import w4a16_gemm, w4a16_linear
    x, qw, s, z, perm = w4_case(m, n, k, group, dtype, device, seed, act_order, pairs)
    ref = w4.w4a16_reference(x, qw, s, z, group, perm).float()
    if split_k is not None or config is not None:
        out = w4a16_gemm(x if perm is None else x[:, perm], qw, s, z, group, split_k, config)
    else:
        out = w4a16_linear(x, qw, s, z, group, perm)
    return errors(out, ref)[1]


def check_w4a16_dequant(n: int, k: int, group: int, dtype, device, seed: int = 0) -> float:
    """Largest |kernel - reference| of the float32 dequantized weight: 0 (the kernel's 2^23 + q
    nibbles give q - z exactly, as the reference's int -> float conversion does)."""
    from minivllm.kernels.w4a16_gemm import w4a16_dequantize
    _, qw, s, z, _ = w4_case(1, n, k, group, dtype, device, seed)
    ref = w4.dequantize(qw, s, z, group).t()
    return (w4a16_dequantize(qw, s, z, group, torch.float32) - ref).abs().max().item()


def check_w4a16_split_fixup(m: int, n: int, k: int, group: int, dtype, device, split_k: int, config: dict,
                            seed: int = 0, pairs: bool = False) -> dict:
    """w4a16_gemm with a forced split_k, called twice on the same inputs (the second call reuses
    the tile counters the first left): {"err": relative error of the first call against the
    reference, "same_bits": both calls gave identical bits, "counters_zero": every counter is 0
    again afterwards (what makes the buffer reusable, CUDA graph replays included)}."""
    from minivllm.kernels import w4a16_gemm as mod
    x, qw, s, z, _ = w4_case(m, n, k, group, dtype, device, seed, pairs=pairs)
    ref = w4.w4a16_reference(x, qw, s, z, group).float()
    first = mod.w4a16_gemm(x, qw, s, z, group, split_k, config)
    second = mod.w4a16_gemm(x, qw, s, z, group, split_k, config)
    from minivllm.kernels.split_k import COUNTERS
    counters = COUNTERS.get(x.device, [])
    bits = (lambda t: t.view({2: torch.int16, 4: torch.int32}[t.element_size()]))  # NaN-proof equality
    return {"err": errors(first, ref)[1], "same_bits": torch.equal(bits(first), bits(second)),
            "counters_zero": all(not bool(c.any()) for c in counters)}


# ---------------------------------------------------------------- FP8 KV cache (any device)


def fp8_caches(case: PagedCase, k_scale: float, v_scale: float):
    """The case's K/V written by the reference into FP8 caches (unwritten slots NaN)."""
    ks = torch.tensor([k_scale], device=case.key.device)
    vs = torch.tensor([v_scale], device=case.key.device)
    k8 = torch.full(case.k_cache.shape, float("nan"), device=case.key.device).to(FP8)
    v8 = torch.full_like(k8, float("nan"))
    store_kv_reference(case.key, case.value, k8, v8, case.slots, ks, vs)
    return k8, v8, ks, vs


def check_fp8_attention(case: PagedCase, kernel: str, k_scale: float = 0.02, v_scale: float = 0.01) -> float:
    """Worst-row relative error of the decode or prefill kernel reading FP8 blocks, against the
    reference reading the same blocks."""
    from minivllm.kernels.decode_attention import decode_attention
    from minivllm.kernels.prefill_attention import prefill_attention
    k8, v8, ks, vs = fp8_caches(case, k_scale, v_scale)
    q = case.query[: case.num_valid]
    ref = paged_attention_reference(q, k8, v8, case.qsl_list, case.seq_lens_list, case.block_tables, case.scale, ks, vs)
    out = torch.full_like(case.query, float("nan"))
    args = (case.query, k8, v8, case.query_start_loc, case.seq_lens, case.block_tables, case.scale)
    if kernel == "decode":
        decode_attention(*args, max_seq_len=max(case.seq_lens_list), out=out, k_scale=ks, v_scale=vs)
    else:
        q_lens = [b - a for a, b in zip(case.qsl_list, case.qsl_list[1:])]
        prefill_attention(*args, max_query_len=max(q_lens), out=out, k_scale=ks, v_scale=vs)
    return errors(out[: case.num_valid], ref)[1]


def check_fp8_store(case: PagedCase, scale: float = 0.02) -> bool:
    """store_kv into FP8 caches writes the reference's bytes (hardware rounding: GPU only)."""
    from minivllm.kernels.store_kv import store_kv
    k8, v8, ks, vs = fp8_caches(case, scale, scale)
    got_k, got_v = torch.full_like(k8, float("nan")), torch.full_like(v8, float("nan"))
    store_kv(case.key, case.value, got_k, got_v, case.slots, ks, vs)
    same = (lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return same(got_k, k8) and same(got_v, v8)


# ---------------------------------------------------------------- GPU tests

def check_fp8_act(kind: str, m: int, h: int, dtype, device, seed: int = 0) -> dict:
    """The fused quantizing norm / SwiGLU (kernels/fp8_act.py) against the unfused pair.

    kind: "norm" (no residual), "add_norm" or "silu". Returns {"bitwise": the fused e4m3 bytes
    and scales equal those of the unfused Triton kernels (the op, then fp8_gemm's quantizer),
    "unfused_scale_err": max relative difference of the two paths' scales, "max_step": the largest
    difference of the two paths' e4m3 codes (same sign: adjacent codes are one rounding step
    apart), "step_share": the share of elements whose codes differ, "scale_err": max relative
    error of the scales against the torch reference's (quant/fp8.quantize_rows of the torch op),
    "residual_equal" (add_norm)}. On the CPU under the interpreter both paths share its float ->
    fp8 conversion (which is not the hardware's: it rounds 126.7 to 64), so the bytes still
    compare. On the GPU a norm's row sum may be compiled in another order in the two kernels
    (lease 18: float16 rows of 12,288 differed in a few codes), so the norms compare within a step."""
    from minivllm.kernels import fp8_act
    from minivllm.kernels.fp8_gemm import quantize_rows_triton
    from minivllm.kernels.fused_ops import (fused_add_rms_norm_torch, fused_add_rms_norm_triton, rms_norm_torch,
                                            rms_norm_triton, silu_and_mul_torch, silu_and_mul_triton)
    from minivllm.quant.fp8 import quantize_rows
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 3).to(dtype).to(device)
    x[0, 1] = 40.0  # an outlier sets the row's scale
    res = {}
    if kind == "silu":
        rows, plain, ref = fp8_act.silu_and_mul_fp8_triton(x), silu_and_mul_triton(x), silu_and_mul_torch(x)
    else:
        w = (torch.rand(h, generator=g) + 0.5).to(dtype).to(device)
        r = torch.randn(m, h, generator=g).to(dtype).to(device) if kind == "add_norm" else None
        rows, r_out = fp8_act.rms_norm_fp8_triton(x, w, 1e-6, r)
        if r is None:
            plain, ref = rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
        else:
            plain, ref = fused_add_rms_norm_triton(x, r, w, 1e-6)[0], fused_add_rms_norm_torch(x, r, w, 1e-6)[0]
            res["residual_equal"] = bool(torch.equal(r_out, x + r))
    q_plain, s_plain = quantize_rows_triton(plain)
    res["bitwise"] = bool(torch.equal(rows.q.view(torch.uint8), q_plain.view(torch.uint8))
                          and torch.equal(rows.scale, s_plain))
    a, b = rows.q.view(torch.uint8).int(), q_plain.view(torch.uint8).int()
    same_sign = ((a ^ b) & 0x80) == 0
    step = torch.where(same_sign, ((a & 0x7F) - (b & 0x7F)).abs(), (a & 0x7F) + (b & 0x7F))  # across zero: both magnitudes
    res["max_step"] = int(step.max())
    res["step_share"] = float((step > 0).float().mean())
    res["unfused_scale_err"] = ((rows.scale - s_plain).abs() / s_plain).max().item()
    s_ref = quantize_rows(ref)[1]
    res["scale_err"] = ((rows.scale - s_ref).abs() / s_ref).max().item()
    return res


gpu = pytest.mark.gpu
DEV = "cuda"


@gpu
@pytest.mark.parametrize("m", [1, 3, 16, 40, 100, 300])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (6144, 4096, 128), (4096, 14336, 128), (1536, 576, 64),
                                         (512, 512, -1)])
def test_w4a16(m: int, n: int, k: int, group: int) -> None:
    assert check_w4a16(m, n, k, group, torch.bfloat16, DEV, seed=m) < 2e-2
    assert check_w4a16(m, n, k, group, torch.float16, DEV, seed=m, act_order=group != -1) < 1e-2


@gpu
@pytest.mark.parametrize("split_k", [1, 2, 8])
@pytest.mark.parametrize("block_m", [1, 16])  # 1: the GEMV kernel
def test_w4a16_split_k(split_k: int, block_m: int) -> None:
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 256}
    assert check_w4a16(3, 4096, 4096, 128, torch.bfloat16, DEV, split_k=split_k, config=cfg) < 2e-2


@gpu
@pytest.mark.parametrize("m, block_m, block_n, block_k, group", [(128, 128, 128, 64, 128), (100, 64, 128, 128, 64),
                                                                 (33, 32, 64, 128, 128), (7, 16, 128, 64, 32)])
def test_w4a16_tiled(m: int, block_m: int, block_n: int, block_k: int, group: int) -> None:
    """The several-row kernel with one scale row a K step (group >= BLOCK_K) and several (group <
    BLOCK_K), ragged row tiles, in both 16-bit dtypes, against the reference."""
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}
    for dtype, tol in ((torch.float16, 1e-2), (torch.bfloat16, 2e-2)):
        assert check_w4a16(m, 4096, 4096, group, dtype, DEV, seed=m, split_k=1, config=cfg) < tol, dtype
        assert check_w4a16(m, 1536, 576, 64, dtype, DEV, seed=m + 1, split_k=2, config=cfg) < tol, dtype


@gpu
def test_w4a16_tiled_kept_launches() -> None:
    """Every launch the kept several-row table gives this GPU (kernels/configs/w4a16_tiled/) on
    its weight, at its row count and at a ragged count below it, against the reference; the
    engine's call (no config) takes the kept launch."""
    from minivllm.kernels import w4a16_gemm as w4k
    from minivllm.kernels.tuned_tables import device_table
    table = device_table(w4k.TILED_CONFIG_DIR, torch.cuda.get_device_name(0))
    if not table:
        pytest.skip("no kept several-row table for this GPU")
    for key, entry in table.items():
        n, k, g = (int(part.split("=")[1]) for part in key.split(","))
        for max_rows, cfg, split, *_ in entry["rows"]:
            assert w4k.tiled_launch(max_rows, n, k, g, torch.device(DEV)) == (cfg, split), key
            for m in (max_rows, max_rows - 5):
                assert check_w4a16(m, n, k, g, torch.float16, DEV, seed=m, split_k=split, config=cfg) < 1e-2, key
            x, qw, s, z, _ = w4_case(max_rows, n, k, g, torch.float16, DEV, seed=5)
            assert torch.equal(w4k.w4a16_gemm(x, qw, s, z, g), w4k.w4a16_gemm(x, qw, s, z, g, split, dict(cfg)))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_gemv_sz_pairs(dtype) -> None:
    """SZ_PAIRS (each scale and zero read as one word from the interleaved tensor the loader
    stores) on W11's weights, ragged N and K too, pipelined or not: as close to the reference as
    the two tiles, and the engine's call takes the pairs path by itself. (Not the tiles' bits:
    the 32-bit pair tile gives Triton another register layout, so the final sum over the K rows
    runs in another order; lease 51 saw last-bit differences without PIPE.)"""
    from minivllm.kernels import w4a16_gemm as w4k
    tol = 1e-2 if dtype == torch.float16 else 2e-2
    for n, k, g in [(6144, 4096, 128), (4096, 4096, 128), (28672, 4096, 128), (4096, 14336, 128), (75, 520, 8 * 65)]:
        for m in (1, 2):
            x, qw, s, z, _ = w4_case(m, n, k, g, dtype, DEV, seed=m)
            _, _, sp, zp, _ = w4_case(m, n, k, g, dtype, DEV, seed=m, pairs=True)
            assert w4k.scale_zero_pairs(sp, zp) and not w4k.scale_zero_pairs(s, z)
            ref = w4.w4a16_reference(x, qw, s, z, g).float()
            cfg, split = w4k.gemv_launch(n, k, g, x.device)
            for pipe in (True, False):
                pairs = w4k.w4a16_gemm(x, qw, sp, zp, g, split, dict(cfg, PIPE=pipe, SZ_PAIRS=True))
                tiles = w4k.w4a16_gemm(x, qw, s, z, g, split, dict(cfg, PIPE=pipe))
                assert errors(pairs, ref)[1] < tol and errors(tiles, ref)[1] < tol, (n, k, m, pipe)
            assert torch.equal(w4k.w4a16_gemm(x, qw, sp, zp, g), w4k.w4a16_gemm(
                x, qw, sp, zp, g, split, dict(cfg, SZ_PAIRS=True))), (n, k, m)


@gpu
def test_w4a16_linear_dense_choice() -> None:
    """Where the kept several-row table timed dequant + cuBLAS faster than the kernel
    (w4a16_gemm.dense_beats_kernel), w4a16_linear takes that path, and both paths agree with the
    reference at those row counts."""
    from minivllm.kernels import w4a16_gemm as w4k
    from minivllm.kernels.tuned_tables import device_table
    table = device_table(w4k.TILED_CONFIG_DIR, torch.cuda.get_device_name(0))
    chosen = [(key, entry["rows"][-1][0]) for key, entry in table.items()
              if entry["rows"][-1][4] < entry["rows"][-1][3]]
    if not chosen:
        pytest.skip("the kept table gives no weight to dequant + cuBLAS below 256 rows")
    for key, rows in chosen:
        n, k, g = (int(part.split("=")[1]) for part in key.split(","))
        assert w4k.dense_beats_kernel(rows, n, k, g, torch.device(DEV)), key
        x, qw, s, z, _ = w4_case(rows, n, k, g, torch.float16, DEV, seed=rows)
        dense = x @ w4k.w4a16_dequantize(qw, s, z, g, x.dtype)
        assert torch.equal(w4k.w4a16_linear(x, qw, s, z, g), dense), key
        assert check_w4a16(rows, n, k, g, torch.float16, DEV, seed=rows) < 1e-2, key


def _gemv_path_cases() -> list:
    """The default path (packed, XPAIR, pipelined) on every shape and split; each other path
    (the formed pairs, the plain math, the unpipelined loop: the A/B switches) on one shape whose
    tiles divide it and one that they do not, at one split. Every path and both EVEN branches are
    covered in 20 cases instead of the cross product's 60 (lease 36 ran those 60 with the rest of
    `-k w4a16` in 7.8 minutes, mostly compiling kernel variants)."""
    shapes = [(4096, 4096, 128), (6144, 4096, 128), (4096, 14336, 128), (1536, 576, 64), (75, 512, 64)]
    cases = [(*shape, split, "xpair", True) for shape in shapes for split in (1, 4)]
    others = [("xpair", False), ("formed", True), ("formed", False), ("plain", True), ("plain", False)]
    cases += [(*shape, 4, path, pipe) for path, pipe in others for shape in (shapes[2], shapes[4])]
    return [pytest.param(*c, id=f"{c[0]}x{c[1]}-g{c[2]}-split{c[3]}-{c[4]}-{'pipelined' if c[5] else 'loop'}")
            for c in cases]


@gpu
@pytest.mark.parametrize("n, k, group, split_k, half2, pipe", _gemv_path_cases())
def test_w4a16_gemv_half2(n: int, k: int, group: int, split_k: int, half2: str, pipe: bool) -> None:
    """The packed 16-bit GEMV (the default for 16-bit activations: kernels/w4a16_gemm.py
    _word_dot_half2), with its activation pairs loaded as words (XPAIR, the default) or formed in
    registers (MINIVLLM_W4A16_GEMV_XPAIR=0), and the plain one (MINIVLLM_W4A16_GEMV_HALF2=0)
    against the reference, in both 16-bit dtypes, with act-order and every zero point; the
    pipelined K loop (PIPE, the default) and the plain one (MINIVLLM_W4A16_GEMV_PIPE=0)."""
    from minivllm.kernels.w4a16_gemm import w4a16_config
    cfg = dict(w4a16_config(1), HALF2=half2 != "plain", PIPE=pipe, XPAIR=half2 == "xpair")
    for m in (1, 2):
        assert check_w4a16(m, n, k, group, torch.bfloat16, DEV, seed=m, split_k=split_k, config=cfg) < 2e-2
        assert check_w4a16(m, n, k, group, torch.float16, DEV, seed=m, split_k=split_k, config=cfg,
                           act_order=True) < 1e-2


@gpu
def test_w4a16_gemv_half2_large_activations() -> None:
    """Activations near float16's limit: the packed partial (scaled by 1/16) must not overflow."""
    from minivllm.kernels.w4a16_gemm import w4a16_config, w4a16_gemm
    x, qw, s, z, _ = w4_case(1, 256, 1024, 128, torch.float16, DEV, seed=3)
    # outlier channels, as some LLM activations have: two in each half of the packed partials of
    # words 0 and 1 (rows 2p and 2p + 1 of a word are its pair p's halves)
    x[0, [0, 1, 2, 3, 8, 9, 10, 11]] = 30000.0
    s = s / 10  # keep the float16 output itself finite
    ref = w4.w4a16_reference(x, qw, s, z, 128, None).float()
    for xpair in (True, False):
        out = w4a16_gemm(x, qw, s, z, 128, split_k=1, config=dict(w4a16_config(1), HALF2=True, XPAIR=xpair))
        assert torch.isfinite(out).all() and errors(out, ref)[1] < 1e-2, xpair


@gpu
def test_w4a16_gemv_takes_xpair_only_on_word_aligned_rows() -> None:
    """XPAIR reads x as 32-bit words: the default launch takes it for contiguous rows and falls
    back to the formed pairs for a view at an odd element offset; both match the reference."""
    from minivllm.kernels.w4a16_gemm import pairs_are_words, w4a16_gemm
    x, qw, s, z, _ = w4_case(1, 4096, 4096, 128, torch.float16, DEV, seed=5)
    wide = torch.zeros(1, 4097, dtype=x.dtype, device=DEV)
    wide[:, 1:] = x
    odd = wide[:, 1:]  # the same values, 2 bytes past a word boundary
    assert pairs_are_words(x) and not pairs_are_words(odd)
    ref = w4.w4a16_reference(x, qw, s, z, 128, None).float()
    a, b = w4a16_gemm(x, qw, s, z, 128), w4a16_gemm(odd, qw, s, z, 128)
    assert errors(a, ref)[1] < 1e-2 and errors(b, ref)[1] < 1e-2


@gpu
@pytest.mark.parametrize("split_k", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("m", [1, 2])
def test_w4a16_gemv_split_fixup(split_k: int, m: int) -> None:
    """The GEMV's in-kernel split-K sum: right, deterministic, and its counters left at 0."""
    cfg = {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 256}
    res = check_w4a16_split_fixup(m, 4101, 4096, 128, torch.bfloat16, DEV, split_k, cfg, seed=split_k)
    assert res["err"] < 2e-2 and res["same_bits"] and res["counters_zero"], res


@gpu
def test_w4a16_split_fixup_in_a_cuda_graph() -> None:
    """Replays of a captured split-K GEMV (and a BLOCK_M 16 GEMM) give the eager call's bits:
    the counters are back at 0 after every kernel, with no memset in the graph."""
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    for m, block_m, split in [(1, 1, 8), (5, 16, 4)]:
        cfg = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 256}
        x, qw, s, z, _ = w4_case(m, 6144, 4096, 128, torch.bfloat16, DEV, seed=m)
        eager = w4a16_gemm(x, qw, s, z, 128, split, cfg)  # also the warm-up: compiles, sizes the counters
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w4a16_gemm(x, qw, s, z, 128, split, cfg)
        for _ in range(3):
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), eager.view(torch.int16)), (m, cfg)


@gpu
def test_w4a16_dequant() -> None:
    assert check_w4a16_dequant(1024, 2048, 128, torch.bfloat16, DEV) == 0.0  # bit for bit


@gpu
@pytest.mark.parametrize("m", [1, 7, 256, 2048])
def test_fp8_linear_matches_reference(m: int) -> None:
    from minivllm.kernels.fp8_gemm import fp8_linear, quantize_rows_triton
    from minivllm.quant.fp8 import fp8_linear_reference, quantize_rows
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 on this GPU")
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    w_q, w_s = quantize_rows(torch.randn(6144, 4096, device=DEV, generator=g) * 0.02)
    q, s = quantize_rows_triton(x)
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    out, ref = fp8_linear(x, w_q, w_s.view(-1)), fp8_linear_reference(x, w_q, w_s.view(-1))
    assert errors(out, ref)[0] < 1e-2


@gpu
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kv_attention(kernel: str, dtype) -> None:
    import random
    kind = "decode" if kernel == "decode" else "mixed"
    case = make_case(random_specs(random.Random(1), 24, 700, kind), 32, 8, 128, 16, dtype, DEV, seed=2)
    assert check_fp8_attention(case, kernel) < 2e-2


@gpu
@pytest.mark.parametrize("widen", ["fp16", "query"])
def test_fp8_kv_decode_widenings(widen: str, monkeypatch) -> None:
    """Both widenings of the FP8 tiles (store_kv.FP8_WIDEN_F16) on bf16 queries (the engine's)."""
    import random
    from minivllm.kernels import store_kv
    monkeypatch.setattr(store_kv, "FP8_WIDEN_F16", widen == "fp16")
    case = make_case(random_specs(random.Random(4), 24, 3000, "decode"), 32, 8, 128, 16, torch.bfloat16, DEV, seed=5)
    assert check_fp8_attention(case, "decode") < 2e-2


@gpu
@pytest.mark.parametrize("kind", ["norm", "add_norm", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, h", [(1, 4096), (37, 4096), (256, 12288), (5, 576)])
def test_fused_fp8_activation_quant_matches_the_unfused_pair(kind: str, dtype, m: int, h: int) -> None:
    """SwiGLU: the same bytes. Norms: the same bytes up to the row sum's float32 order (at most one
    rounding step in a few elements, scales within 1e-6). The residual is always exact."""
    r = check_fp8_act(kind, m, h, dtype, DEV, seed=m + h)
    assert r.get("residual_equal", True), r
    if kind == "silu":
        assert r["bitwise"], r
    else:
        assert r["max_step"] <= 1 and r["step_share"] < 5e-3 and r["unfused_scale_err"] < 1e-6, r


@gpu
def test_fp8_kv_store() -> None:
    import random
    case = make_case(random_specs(random.Random(3), 8, 300, "mixed"), 32, 8, 128, 16, torch.bfloat16, DEV, seed=4)
    assert check_fp8_store(case)


# ---------------------------------------------------------------- the engine on the GPU


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory):
    from minivllm.models.source import default_gguf_path
    from minivllm.quant import export
    pytest.importorskip("gguf")  # transformers reads the bundled GGUF through it
    try:
        gguf = default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("quant")
    return export.write_all(gguf, str(out), ("awq", "gptq-act", "ct-w4a16-asym", "ct-fp8"), 64)


def _capital_of_france(llm) -> str:
    from minivllm import SamplingParams
    from minivllm.engine.tokenizer import apply_chat_template
    ids = apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    return out[0].outputs[0].text


@gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq-act", "ct-w4a16-asym", "ct-fp8"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_quantized_default_model_on_gpu(quantized_dirs, fmt: str, kv: str) -> None:
    """Real checkpoint files on the GPU kernels (CUDA graphs on): every quantized layer's output
    equals the reference product of its own tensors, and the model still answers."""
    from minivllm import LLM
    from minivllm.quant.fp8 import fp8_linear_reference
    from minivllm.quant.layer import QuantLinear
    allocated_before = torch.cuda.memory_allocated()
    llm = LLM(model=quantized_dirs[fmt], device="cuda", dtype="float16", kv_cache_dtype=kv,
              gpu_memory_utilization=0.3)
    model = llm.llm_engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * model.cfg.num_layers
    x = torch.randn(5, layers[0].in_features, device="cuda", dtype=torch.float16)
    lin = layers[0]
    if fmt == "ct-fp8":
        ref = fp8_linear_reference(x, lin.weight_fp8, lin.weight_scale_f32, lin.bias)
    else:
        ref = w4.w4a16_reference(x, lin.qweight, lin.scales, lin.zeros, lin.group_size, lin.perm, lin.bias)
        from minivllm.kernels.w4a16_gemm import scale_zero_pairs  # the loader interleaves them (one word each)
        assert scale_zero_pairs(lin.scales, lin.zeros)
    assert errors(lin(x), ref)[0] < 1e-2
    if fmt == "ct-fp8":  # the norms and SwiGLUs before its linears quantize (kernels/fp8_act.py)
        from minivllm.models.layers import MLP
        assert all(m.fp8_act for m in model.modules() if isinstance(m, MLP))
    assert "Paris" in _capital_of_france(llm)
    llm.llm_engine.shutdown()
    # the next parameter's engine plans its KV cache from the free memory: this one's cache and
    # graphs must be gone first (lease 7: the second engine found no room for a single block)
    del llm, model, layers, lin
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    # (the engine froze its startup heap: without the unfreeze at shutdown its cycles, and the
    # KV cache and graphs they hold, stayed allocated; lease 8). The bound leaves room for what
    # torch keeps per process once the first engine has run: cuBLAS workspaces of the streams it
    # used and the split-K counters (lease 22: 64.03 MiB left after the first parameter, against a
    # KV cache of gigabytes at gpu_memory_utilization 0.3)
    assert torch.cuda.memory_allocated() - allocated_before < 256 << 20


@gpu
def test_w4a16_gemv_kept_launches() -> None:
    """Every launch the kept GEMV table gives this GPU (kernels/configs/w4a16_gemv/, what the engine
    runs for one or two rows of those weights) against the reference, in both 16-bit dtypes."""
    from minivllm.kernels import w4a16_gemm as w4k
    from minivllm.kernels.tuned_tables import device_table
    table = device_table(w4k.GEMV_CONFIG_DIR, torch.cuda.get_device_name(0))
    if not table:
        pytest.skip("no kept GEMV table for this GPU")
    for key in table:
        n, k, g = (int(part.split("=")[1]) for part in key.split(","))
        cfg, split = w4k.gemv_launch(n, k, g, torch.device(DEV))
        assert cfg["BLOCK_N"] == table[key]["tile"][0] and split == table[key]["split_k"], key
        for m in (1, 2):
            assert check_w4a16(m, n, k, g, torch.float16, DEV, seed=m, split_k=split, config=cfg) < 1e-2, key
            assert check_w4a16(m, n, k, g, torch.bfloat16, DEV, seed=m, split_k=split, config=cfg) < 2e-2, key
        x, qw, s, z, _ = w4_case(1, n, k, g, torch.float16, DEV, seed=5)  # the engine's call takes the kept launch
        assert torch.equal(w4k.w4a16_gemm(x, qw, s, z, g), w4k.w4a16_gemm(x, qw, s, z, g, split_k=split, config=cfg))
