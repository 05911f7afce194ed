"""The experimental persistent GEMV chain (kernels/gemv_chain.py) against the same GEMVs launched
one by one (w4a16_gemm with the chain's tile and K slices: the same bits expected) and against the
float reference per stage.

The check helper is device-agnostic: tests/unit/test_gemv_chain_interpret.py runs it under
Triton's interpreter with one program (programs run one after another there, so a wider grid's
barrier could never open); the test here runs it on the GPU with as many programs as fit at once.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the interpreter child loads this file by path
from test_triton_kernels import errors  # noqa: E402

from minivllm.quant import w4  # noqa: E402


def check_chain(shapes: list[tuple[int, int]], group: int, device, programs: int | None, block_n: int = 32,
                block_k: int = 64, split_k: int = 2, seed: int = 0, max_polls: int = 1 << 22) -> dict:
    """{"same_bits": every stage's output equals the separate launches', "max_err": the largest
    relative error of a stage against the reference on its own input, "counters_zero": the
    split-K tile counters are all 0 afterwards, "programs": the grid, "timed_out": a barrier gave
    up}. programs None: as many as fit at once on the GPU."""
    from minivllm.kernels.gemv_chain import GemvChain, chain_meta, random_stages
    from minivllm.kernels.split_k import COUNTERS
    from minivllm.kernels.w4a16_gemm import w4a16_gemm
    stages = random_stages(shapes, group, device, seed)
    even = all(n % block_n == 0 and k % block_k == 0 for n, k in shapes)
    half2 = torch.device(device).type == "cuda"
    chain = GemvChain(chain_meta(stages), max(n for n, _ in shapes), programs or 1, group=group, block_n=block_n,
                      block_k=block_k, split_k=split_k, half2=half2, even=even, max_polls=max_polls)
    if programs is None:
        chain.programs = chain.resident_limit()
    chain()
    cfg = {"BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3, "PIPE": True}
    same, worst, x = True, 0.0, stages[0][3]
    for qw, sc, z, x_chain, out in stages:
        k = qw.shape[0] * 8
        separate = w4a16_gemm(x[:k].view(1, k), qw, sc, z, group, split_k, dict(cfg)).view(-1)
        same = same and torch.equal(separate.view(torch.int16), out.view(torch.int16))
        ref = w4.w4a16_reference(x_chain[:k].view(1, k).float(), qw, sc.float(), z.float(), group).view(-1)
        worst = max(worst, errors(out.view(1, -1), ref.view(1, -1))[1])
        x = separate
    counters = COUNTERS.get(torch.device(device), [])
    return {"same_bits": bool(same), "max_err": worst, "programs": chain.programs, "timed_out": chain.timed_out(),
            "counters_zero": all(not bool(c.any()) for c in counters)}


@pytest.mark.gpu
def test_gemv_chain_on_the_gpu() -> None:
    """Llama-3.1-8B's layer shapes (qkv, o, gate_up, down) twice, with the engine's GEMV tile,
    every program resident; and a narrower grid (items several per program)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    layer = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    for programs in (None, 8):
        res = check_chain(layer * 2, 128, "cuda", programs, block_n=32, block_k=256, split_k=4)
        assert res["same_bits"] and res["max_err"] < 1e-2 and res["counters_zero"] and not res["timed_out"], res
