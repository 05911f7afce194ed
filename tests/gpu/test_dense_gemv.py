"""The dense batch-1 GEMV (kernels/dense_gemv.py) against F.linear in float64.

`check_dense_gemv` is device-agnostic: tests/unit/test_dense_gemv_interpret.py runs it on the
CPU under Triton's interpreter with small shapes; the tests here run it on the GPU with the
benchmark models' shapes, in eager mode and inside a CUDA graph (the split-K counters must be
back to 0 after every replay). Outputs are written into NaN-poisoned memory first (an unwritten
element stays NaN).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative, per row


def _case(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int, bias: bool, x_stride: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(m, k + x_stride, generator=g).to(dtype)[:, :k]  # x_stride > 0: strided rows
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return xs.to(device), w.to(device), None if b is None else b.to(device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    diff = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-9)
    return diff.max().item()


def check_dense_gemv(m: int, n: int, k: int, dtype: torch.dtype, device: str, tile: dict, split_k: int | None,
                     bias: bool = False, seed: int = 0, x_stride: int = 0) -> float:
    """Worst per-row relative error of dense_gemv against float64 F.linear."""
    from minivllm.kernels.dense_gemv import dense_gemv
    x, w, b = _case(m, n, k, dtype, device, seed, bias, x_stride)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return _rel_err(dense_gemv(x, w, b, tile, split_k), ref)


def check_gemv_linear_rows(device: str, dtype: torch.dtype) -> dict[str, float]:
    """GemvLinear: 1 and 2 rows through the GEMV, 3 and 9 through F.linear; each against float64."""
    from minivllm.kernels.dense_gemv import GEMV_MAX_ROWS, GemvLinear
    lin = torch.nn.Linear(96, 40, bias=True).to(device=device, dtype=dtype)
    layer = GemvLinear(lin, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1, "SPLIT_K": 2})
    assert layer.weight is lin.weight  # the same Parameter (tied weights stay tied)
    out = {}
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 9):
        x = torch.randn(rows, 96, device=device).to(dtype)
        ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        out[f"rows {rows}"] = _rel_err(layer(x), ref)
    return out


# ---------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu
SHAPES = [(2048, 5120), (4096, 2048), (2048, 128), (576, 960), (1536, 576), (4096, 6144), (14336, 4096)]  # (K, N)


@gpu
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_dense_gemv_matches_linear_on_gpu(k: int, n: int, m: int) -> None:
    from minivllm.kernels.dense_gemv import DEFAULT_TILE
    for split in (None, 1, 4):
        err = check_dense_gemv(m, n, k, torch.bfloat16, "cuda", DEFAULT_TILE, split, bias=n == 128, seed=k + n)
        assert err < TOL[torch.bfloat16], (k, n, m, split, err)


@gpu
def test_dense_gemv_in_a_cuda_graph_replays_correctly() -> None:
    """Split-K in a graph: the counters reset themselves, so every replay gives the right answer
    for new inputs copied into the captured buffers."""
    from minivllm.kernels.dense_gemv import dense_gemv
    k, n = 4096, 2048
    x, w, _ = _case(1, n, k, torch.bfloat16, "cuda", 1, False)
    tile = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    dense_gemv(x, w, None, tile, 8)  # sizes the counters outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_gemv(x, w, None, tile, 8)
    for seed in range(4):
        x.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, F.linear(x.double(), w.double())) < TOL[torch.bfloat16]


@gpu
def test_gemv_linear_rows_on_gpu() -> None:
    for name, err in check_gemv_linear_rows("cuda", torch.bfloat16).items():
        assert err < TOL[torch.bfloat16], (name, err)
