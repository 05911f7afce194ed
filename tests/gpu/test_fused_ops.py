"""The fused per-token kernels (RMSNorm, add + RMSNorm, rotary, SiLU-and-mul) against the torch math.

The `check_*` helpers are device-agnostic and return a list of failure strings (empty = pass):
tests/unit/test_fused_ops_interpret.py runs them on the CPU under TRITON_INTERPRET=1 with small
shapes; the tests here run them on a CUDA GPU with realistic ones.

Poisoning: outputs are preallocated as NaN views inside larger NaN buffers (an element the
kernel forgets to write stays NaN; a write past the row shows in the padding), and q/k for the
rotary and q/k-norm checks are strided views of a fused qkv buffer whose other columns are NaN
(a read outside q/k turns the result NaN; a write there changes the NaN bits).

Tolerance: the kernels round where torch rounds, so low-precision outputs equal the reference
bit for bit except for rare one-ulp flips (fp32 reduction order, FMA contraction, the GPU's
exp): elementwise |out - ref| <= atol + rtol |ref| with rtol = two ulps, and at least 99% of
bf16/fp16 elements exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import fused_ops as F

TOLS = {  # dtype -> (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 2 * 2.0 ** -10),
    torch.bfloat16: (1e-5, 2 * 2.0 ** -7),
}
MIN_EXACT = 0.99  # fraction of bf16/fp16 elements equal bit for bit
EPS = 1e-6


# ---------------------------------------------------------------- helpers (any device)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator, scale: float = 1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _nan_view(rows: int, cols: int, dtype: torch.dtype, device: str, pad: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer [rows, cols + pad] of NaN, its view [rows, cols]): row stride != cols."""
    buf = torch.full((rows, cols + pad), float("nan"), dtype=dtype, device=device)
    return buf, buf[:, :cols]


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> list[str]:
    """Elementwise |out - ref| <= atol + rtol * scale, scale = |ref| unless given (see
    check_qk_norm_rotary), and MIN_EXACT of low-precision elements bit-identical."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return [f"{name}: shape/dtype {tuple(out.shape)} {out.dtype} != {tuple(ref.shape)} {ref.dtype}"]
    atol, rtol = TOLS[ref.dtype]
    o, r = out.float(), ref.float()
    if torch.isnan(o).any():
        return [f"{name}: {int(torch.isnan(o).sum())} NaN elements (unwritten or read out of bounds)"]
    err = (o - r).abs()
    bad = err > atol + rtol * (r.abs() if scale is None else scale)
    fails = []
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        fails.append(f"{name}: {int(bad.sum())}/{bad.numel()} beyond tolerance, max abs err "
                     f"{err.max().item():.3g}, first at flat index {i}: {o.flatten()[i].item()} vs {r.flatten()[i].item()}")
    if ref.dtype != torch.float32 and out.numel():
        exact = (out == ref).float().mean().item()
        if exact < MIN_EXACT:
            fails.append(f"{name}: only {exact:.4f} of elements bit-identical (< {MIN_EXACT})")
    return fails


def _still_nan(name: str, region: torch.Tensor) -> list[str]:
    n = int((~torch.isnan(region)).sum())
    return [f"{name}: {n} poisoned elements outside the output were overwritten"] if n else []


def check_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    x_buf = _rand((tokens, hidden + 16), dtype, device, gen, scale=3.0)  # strided input rows
    x = x_buf[:, :hidden]
    w = _rand((hidden,), dtype, device, gen)
    ref = F.rms_norm_torch(x, w, EPS)
    buf, out = _nan_view(tokens, hidden, dtype, device)
    got = F.rms_norm_triton(x, w, EPS, out=out)
    fails = compare("rms_norm", got, ref) + _still_nan("rms_norm padding", buf[:, hidden:])
    fails += compare("rms_norm (allocating)", F.rms_norm_triton(x, w, EPS), ref)
    return fails


def _qkv(tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype, device: str,
         gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv buffer [T, (Hq + 2 Hk) D] with V (and 8 spare columns) NaN; q, k strided views."""
    q_size, kv_size = num_q * head_dim, num_k * head_dim
    qkv = torch.full((tokens, q_size + 2 * kv_size + 8), float("nan"), dtype=dtype, device=device)
    qkv[:, :q_size + kv_size] = _rand((tokens, q_size + kv_size), dtype, device, gen, scale=2.0)
    q = qkv[:, :q_size].view(tokens, num_q, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, num_k, head_dim)
    return qkv, q, k


def check_head_norm(tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                    seed: int = 0) -> list[str]:
    """q/k-norm: rms_norm over [T, heads, D] strided views of a qkv buffer."""
    gen = torch.Generator().manual_seed(seed)
    qkv, q, k = _qkv(tokens, num_heads, max(1, num_heads // 4), head_dim, dtype, device, gen)
    w = _rand((head_dim,), dtype, device, gen)
    fails = compare("head rms_norm q", F.rms_norm_triton(q, w, EPS), F.rms_norm_torch(q, w, EPS))
    fails += compare("head rms_norm k", F.rms_norm_triton(k, w, EPS), F.rms_norm_torch(k, w, EPS))
    return fails


def check_fused_add_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    x = _rand((tokens, hidden), dtype, device, gen, scale=2.0)
    res = _rand((tokens, hidden), dtype, device, gen, scale=4.0)
    w = _rand((hidden,), dtype, device, gen)
    ref_out, ref_res = F.fused_add_rms_norm_torch(x, res, w, EPS)
    out_buf, out = _nan_view(tokens, hidden, dtype, device)
    res_buf, res_out = _nan_view(tokens, hidden, dtype, device)
    x0, r0 = x.clone(), res.clone()
    got_out, got_res = F.fused_add_rms_norm_triton(x, res, w, EPS, out=out, residual_out=res_out)
    fails = compare("fused_add out", got_out, ref_out) + compare("fused_add residual", got_res, ref_res)
    fails += _still_nan("fused_add out padding", out_buf[:, hidden:])
    fails += _still_nan("fused_add residual padding", res_buf[:, hidden:])
    if not (torch.equal(x, x0) and torch.equal(res, r0)):
        fails.append("fused_add (not inplace) modified its inputs")
    got_out, got_res = F.fused_add_rms_norm_triton(x, res, w, EPS, inplace=True)
    if got_out.data_ptr() != x.data_ptr() or got_res.data_ptr() != res.data_ptr():
        fails.append("fused_add inplace did not return its input buffers")
    fails += compare("fused_add inplace out", got_out, ref_out) + compare("fused_add inplace residual", got_res, ref_res)
    return fails


def check_rotary(tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype, device: str,
                 seed: int = 0, max_pos: int = 8192) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    qkv, q, k = _qkv(tokens, num_q, num_k, head_dim, dtype, device, gen)
    cos_sin = _rand((max_pos, head_dim), torch.float32, device, gen)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    ref_q, ref_k = F.apply_rotary_torch(positions, q, k, cos_sin)
    got_q, got_k = F.apply_rotary_triton(positions, q, k, cos_sin)
    if got_q.data_ptr() != q.data_ptr() or got_k.data_ptr() != k.data_ptr():
        return ["rotary did not return its (in-place) inputs"]
    fails = compare("rotary q", got_q, ref_q) + compare("rotary k", got_k, ref_k)
    fails += _still_nan("rotary v / spare columns", qkv[:, q.shape[1] * head_dim + k.shape[1] * head_dim:])
    pos32 = positions.to(torch.int32)  # int32 positions take the same path
    _, q2, k2 = _qkv(tokens, num_q, num_k, head_dim, dtype, device, torch.Generator().manual_seed(seed))
    got_q, got_k = F.apply_rotary_triton(pos32, q2, k2, cos_sin)
    fails += compare("rotary q int32 positions", got_q, ref_q) + compare("rotary k int32 positions", got_k, ref_k)
    return fails


def check_qk_norm_rotary(tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype, device: str,
                         seed: int = 0, max_pos: int = 8192) -> list[str]:
    """Qwen3's q/k RMSNorm then rotary in one kernel, against the torch ops one after the other
    (the norm's output rounded to the dtype before the rotation, as the unfused path stores it).

    The tolerance is relative to the rotation's terms, |x1 cos| + |x2 sin|, not to the result:
    a normed element may round one ulp apart (the kernel's fp32 sum of squares runs in another
    order than torch's), and x1 cos - x2 sin can cancel to a value far smaller than its terms,
    which turns that one ulp of a term into many ulps of the result (lease 11: 1 of 524,288 fp16
    elements, -0.0109 off by 0.0039 = two ulps of a term near 2)."""
    gen = torch.Generator().manual_seed(seed)
    qkv, q, k = _qkv(tokens, num_q, num_k, head_dim, dtype, device, gen)
    qw, kw = _rand((head_dim,), dtype, device, gen), _rand((head_dim,), dtype, device, gen)
    cos_sin = _rand((max_pos, head_dim), torch.float32, device, gen)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    normed_q, normed_k = F.rms_norm_torch(q, qw, EPS), F.rms_norm_torch(k, kw, EPS)
    ref_q, ref_k = F.apply_rotary_torch(positions, normed_q, normed_k, cos_sin)
    scale_q, scale_k = (_rotation_terms(positions, x, cos_sin) for x in (normed_q, normed_k))
    got_q, got_k = F.apply_rotary_triton(positions, q, k, cos_sin, qw, kw, EPS)
    if got_q.data_ptr() != q.data_ptr() or got_k.data_ptr() != k.data_ptr():
        return ["qk_norm_rotary did not return its (in-place) inputs"]
    fails = compare("qk_norm_rotary q", got_q, ref_q, scale_q) + compare("qk_norm_rotary k", got_k, ref_k, scale_k)
    fails += _still_nan("qk_norm_rotary v / spare columns", qkv[:, q.shape[1] * head_dim + k.shape[1] * head_dim:])
    return fails


def check_rotary_store_kv(tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype, device: str,
                          seed: int = 0, norm: bool = False, fp8: bool = False, block_size: int = 16,
                          max_pos: int = 64) -> list[str]:
    """store_kv.rotary_store_kv (rotary, with norm Qwen3's q/k RMSNorm first, and the K/V store in
    one kernel) against the two kernels it replaces, apply_rotary_triton then store_kv: the same
    bits in q and in every cache slot, for a step whose last token is padding (slot -1: its
    slot keeps its old bytes); k and v in the qkv buffer are left as they were."""
    from minivllm.kernels.store_kv import rotary_store_kv, store_kv
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_q * head_dim, num_k * head_dim
    qkv = _rand((tokens, q_size + 2 * kv_size), dtype, device, gen, scale=2.0)
    weights = (_rand((head_dim,), dtype, device, gen), _rand((head_dim,), dtype, device, gen)) if norm else None
    cos_sin = _rand((max_pos, head_dim), torch.float32, device, gen)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    num_blocks = tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    if tokens > 1:
        slots[-1] = -1
    slots = slots.to(device)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    old = _rand((2, num_blocks, block_size, num_k, head_dim), torch.float32, device, gen).to(cache_dtype)
    scales = (torch.tensor([0.02], device=device), torch.tensor([0.03], device=device)) if fp8 else (None, None)

    def views(buf):
        return (buf[:, :q_size].view(tokens, num_q, head_dim), buf[:, q_size:q_size + kv_size].view(tokens, num_k, head_dim),
                buf[:, q_size + kv_size:].view(tokens, num_k, head_dim))

    apart, fused = qkv.clone(), qkv.clone()
    kc_a, vc_a = old[0].clone(), old[1].clone()
    kc_f, vc_f = old[0].clone(), old[1].clone()
    q, k, v = views(apart)
    q, k = F.apply_rotary_triton(positions, q, k, cos_sin, *(weights or (None, None)), EPS)
    store_kv(k, v, kc_a, vc_a, slots, *scales)
    qf, kf, vf = views(fused)
    got = rotary_store_kv(positions, qf, kf, vf, cos_sin, kc_f, vc_f, slots, *scales, weights, EPS)
    fails = []
    if got.data_ptr() != qf.data_ptr():
        fails.append("rotary_store_kv did not return its (in-place) q")

    def bits(x):
        return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16 if x.element_size() == 2 else torch.int32)

    for name, a, b in [("q", q, got), ("k cache", kc_a, kc_f), ("v cache", vc_a, vc_f),
                       ("qkv k and v", qkv[:, q_size:], fused[:, q_size:])]:
        if not torch.equal(bits(a.contiguous()), bits(b.contiguous())):
            fails.append(f"{name} differs from the unfused kernels")
    return fails


def _rotation_terms(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """|x1 cos| + |x2 sin| and |x2 cos| + |x1 sin|: the magnitude of the terms each rotated element
    sums (x [T, heads, D], the halves as apply_rotary_torch splits them)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([(x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()], dim=-1)


def check_silu_and_mul(tokens: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = _rand((tokens, 2 * inter), dtype, device, gen, scale=3.0)
    ref = F.silu_and_mul_torch(gate_up)
    buf, out = _nan_view(tokens, inter, dtype, device)
    got = F.silu_and_mul_triton(gate_up, out=out)
    fails = compare("silu_and_mul", got, ref) + _still_nan("silu_and_mul padding", buf[:, inter:])
    # a strided input row (gate_up as a column slice of a wider buffer)
    wide = _rand((tokens, 2 * inter + 24), dtype, device, gen, scale=3.0)
    fails += compare("silu_and_mul strided", F.silu_and_mul_triton(wide[:, :2 * inter]),
                     F.silu_and_mul_torch(wide[:, :2 * inter]))
    return fails


def check_dispatch(device: str) -> list[str]:
    """The public wrappers: kernel path on CUDA, torch path (bit for bit) elsewhere."""
    gen = torch.Generator().manual_seed(7)
    x, r = _rand((5, 64), torch.float32, device, gen), _rand((5, 64), torch.float32, device, gen)
    w = _rand((64,), torch.float32, device, gen)
    fails = []
    if device == "cpu":
        if not torch.equal(F.rms_norm(x, w, EPS), F.rms_norm_torch(x, w, EPS)):
            fails.append("rms_norm on CPU is not the torch math")
        a, b = F.fused_add_rms_norm(x, r, w, EPS)
        a2, b2 = F.fused_add_rms_norm_torch(x, r, w, EPS)
        if not (torch.equal(a, a2) and torch.equal(b, b2)):
            fails.append("fused_add_rms_norm on CPU is not the torch math")
        if not torch.equal(F.silu_and_mul(x), F.silu_and_mul_torch(x)):
            fails.append("silu_and_mul on CPU is not the torch math")
    else:
        fails += compare("rms_norm wrapper", F.rms_norm(x, w, EPS), F.rms_norm_torch(x, w, EPS))
        fails += compare("fused_add wrapper", F.fused_add_rms_norm(x, r, w, EPS)[0],
                         F.fused_add_rms_norm_torch(x, r, w, EPS)[0])
        fails += compare("silu_and_mul wrapper", F.silu_and_mul(x), F.silu_and_mul_torch(x))
    return fails


# ---------------------------------------------------------------- GPU tests

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 7, 256, 4096]
cuda = pytest.mark.gpu


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 1024, 4096])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    assert not check_rms_norm(tokens, hidden, dtype, "cuda", seed=tokens + hidden)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 1024, 4096])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    assert not check_fused_add_rms_norm(tokens, hidden, dtype, "cuda", seed=tokens + hidden)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,head_dim", [(16, 128), (32, 128), (14, 64), (9, 64)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_head_rms_norm(tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    assert not check_head_norm(tokens, num_heads, head_dim, dtype, "cuda", seed=tokens + num_heads)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_q,num_k,head_dim", [(16, 8, 128), (32, 8, 128), (14, 2, 64), (9, 3, 64), (40, 40, 128)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary(tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype) -> None:
    assert not check_rotary(tokens, num_q, num_k, head_dim, dtype, "cuda", seed=tokens + num_q)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_q,num_k,head_dim", [(16, 8, 128), (32, 4, 128), (32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_rotary(tokens: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype) -> None:
    assert not check_qk_norm_rotary(tokens, num_q, num_k, head_dim, dtype, "cuda", seed=tokens + num_k)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1536, 3072, 14336, 100])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(tokens: int, inter: int, dtype: torch.dtype) -> None:
    assert not check_silu_and_mul(tokens, inter, dtype, "cuda", seed=tokens + inter)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_q,num_k,head_dim", [(32, 8, 128), (16, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 3, 130])
def test_rotary_store_kv_gives_the_unfused_bits(tokens: int, num_q: int, num_k: int, head_dim: int,
                                                dtype: torch.dtype) -> None:
    for norm, fp8 in [(False, False), (True, False), (False, True), (True, True)]:
        if fp8 and dtype == torch.float32:
            continue
        fails = check_rotary_store_kv(tokens, num_q, num_k, head_dim, dtype, "cuda", seed=tokens + num_q, norm=norm,
                                      fp8=fp8)
        assert not fails, (norm, fp8, fails)


@cuda
def test_wrappers_dispatch_to_kernels_on_cuda() -> None:
    assert not check_dispatch("cuda")


@cuda
def test_empty_batch() -> None:
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    assert F.rms_norm(x, w, EPS).shape == (0, 64)
    assert F.fused_add_rms_norm(x, x.clone(), w, EPS)[1].shape == (0, 64)
    assert F.silu_and_mul(x).shape == (0, 32)
    q = torch.empty(0, 4, 64, device="cuda", dtype=torch.bfloat16)
    cs = torch.zeros(16, 64, device="cuda")
    assert F.apply_rotary(torch.empty(0, dtype=torch.int64, device="cuda"), q, q[:, :2], cs)[0].shape == (0, 4, 64)
