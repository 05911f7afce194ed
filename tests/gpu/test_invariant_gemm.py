"""The batch-invariant matmul (kernels/invariant_gemm.py) against torch, and its invariance:
a row's result has the same bits alone, among other rows at any position, and in a CUDA graph.
The checks are shared with tests/unit/test_invariant_gemm_interpret.py (CPU, interpreter)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def check_matmul(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int, bias: bool,
                 bitwise: bool = True) -> list[str]:
    """Problems found (empty: all good): the product within tolerance of torch's (fp32 reference),
    and (bitwise) a few rows equal bit for bit alone, inside the batch and shifted by one row.
    Under the interpreter tl.dot is numpy's matmul of the tile, whose bits depend on the tile's
    contents: there only the product is checked."""
    from minivllm.kernels.invariant_gemm import invariant_matmul
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
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
