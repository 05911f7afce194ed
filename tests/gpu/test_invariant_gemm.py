"""The batch-invariant matmul (kernels/invariant_gemm.py) against torch, and its invariance:
a row's result has the same bits alone, among other rows at any position, and in a CUDA graph.
The checks are shared with tests/unit/test_invariant_gemm_interpret.py (CPU, interpreter)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def random_operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int,
                    bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [m, k], weight [n, k] scaled by 1/sqrt(k), and a bias [n] (or None), drawn on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def check_matmul(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int, bias: bool,
                 bitwise: bool = True) -> list[str]:
    """Problems found (empty: all good): the product within tolerance of torch's (fp32 reference),
    and (bitwise) a few rows equal bit for bit alone, inside the batch and shifted by one row.
    Under the interpreter tl.dot is numpy's matmul of the tile, whose bits depend on the tile's
    contents: there only the product is checked."""
    from minivllm.kernels.invariant_gemm import invariant_matmul
    x, w, b = random_operands(m, n, k, dtype, device, seed, bias)
    y = invariant_matmul(x, w, b)
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    problems = []
    err = float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    if not err < tol:
        problems.append(f"relative error {err:.3g} >= {tol}")
    if not bitwise:
        return problems
    for r in sorted({0, m // 2, m - 1}):
        alone = invariant_matmul(x[r:r + 1], w, b)
        if not torch.equal(alone[0], y[r]):
            problems.append(f"row {r} alone differs from row {r} of {m}")
    shifted = invariant_matmul(torch.cat([x[m - 1:], x]), w, b)  # every row one position later
    if not torch.equal(shifted[1:], y):
        problems.append("rows shifted by one position differ")
    return problems


def check_launches(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int, bias: bool,
                   launches: list[tuple[tuple[int, int, int, int, int], bool]],
                   base_tile: tuple[int, int, int, int, int] | None = None) -> list[str]:
    """Problems found: each (tile, in_program) launch must give the fixed launch's bits. The
    launch table (kernels/configs/invariant_gemm/) picks launches by the row count, which keeps a
    row's bits independent of the batch only if every launch gives the same bits; in_program
    (the weight's K slices walked in one program and summed in order) must equal the split-K
    fix-up across programs. base_tile: compare with that tile's split-K launch instead (under the
    interpreter, whose products depend on the tile)."""
    from minivllm.kernels.device import num_sms
    from minivllm.kernels.invariant_gemm import fixed_launch, invariant_matmul
    x, w, b = random_operands(m, n, k, dtype, device, seed, bias)
    base = invariant_matmul(x, w, b, tile=base_tile or fixed_launch(n, num_sms(device)))
    problems = []
    for tile, in_program in launches:
        got = invariant_matmul(x, w, b, tile=tile, in_program=in_program)
        if not torch.equal(got, base):
            diff = float((got.float() - base.float()).abs().max())
            problems.append(f"m {m} n {n} k {k}: launch {tile} in_program={in_program} differs (max {diff:.3g})")
    return problems


# tiles of 16 to 128 rows and 32 to 256 columns, K steps of 64 and 128, 4 or 8 warps, in_program
# on and off (only weights whose K is split have a difference there: Qwen3-0.6B's o and down)
LAUNCHES = [((16, 32, 128, 4, 4), False), ((16, 64, 256, 4, 3), False), ((64, 64, 64, 8, 3), False),
            ((128, 128, 64, 8, 3), True), ((128, 256, 64, 8, 3), True), ((64, 32, 64, 4, 3), True),
            ((32, 64, 128, 4, 4), True)]


@pytest.mark.parametrize("m,n,k", [(1, 1024, 2048), (300, 1024, 3072), (2000, 1024, 2048), (77, 4096, 1024),
                                   (1, 151936, 1024), (300, 6144, 1024)])
def test_every_launch_gives_the_same_bits(m, n, k):
    assert check_launches(m, n, k, torch.bfloat16, "cuda", seed=m + n, bias=n == 4096, launches=LAUNCHES) == []


def test_table_launches_give_the_fixed_launch_bits():
    """Every launch the kept table names for this GPU, at its own row count and at others."""
    from minivllm.kernels.invariant_gemm import launch_table
    table = launch_table(torch.cuda.get_device_name(0))
    if not table:
        pytest.skip("no launch table kept for this GPU")
    problems = []
    for key, entry in table.items():
        n, k = (int(part.split("=")[1]) for part in key.split(","))
        launches = [(tuple(tile), bool(inp)) for _, tile, inp in entry["rows"]]
        for m in (1, 200, 1500):
            problems += check_launches(m, n, k, torch.bfloat16, "cuda", seed=m, bias=False, launches=launches)
    assert problems == []


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 6144, 4096), (200, 1024, 3072), (333, 151936, 1024)])
def test_invariant_matmul_bf16(m, n, k):
    assert check_matmul(m, n, k, torch.bfloat16, "cuda", seed=m, bias=False) == []


def test_invariant_matmul_fp32_and_bias():
    assert check_matmul(65, 384, 192, torch.float32, "cuda", seed=1, bias=True) == []


def test_invariant_matmul_in_a_cuda_graph():
    from minivllm.kernels.invariant_gemm import invariant_matmul
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 32
    eager = invariant_matmul(x, w)
    invariant_matmul(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = invariant_matmul(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
