"""Programmatic dependent launch (kernels/pdl.py) in the decode path's kernels, compiled for an
H100 (sm_90) on the CPU through Triton's own ptxas: Triton's interpreter does not run
griddepcontrol, so CI checks the contract on the generated PTX (the numbers with PDL on are
tests/gpu/test_pdl.py's).

The contract: with PDL every kernel waits (griddepcontrol.wait) before any load of data another
kernel writes and before any store or atomic; before the wait only L2 prefetches of weights
(and, in the MoE down kernel, the expert ids the top-k kernel wrote two launches back, read
through L2; in the decode attention, the step's metadata, which no kernel of the step writes,
read through L2). Without PDL no griddepcontrol instruction is emitted at all."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from minivllm.kernels import decode_attention as da  # noqa: E402
from minivllm.kernels import dense_gemv as dg  # noqa: E402
from minivllm.kernels import fp8_act as fa  # noqa: E402
from minivllm.kernels import fused_moe as fm  # noqa: E402
from minivllm.kernels import fused_ops as fo  # noqa: E402
from minivllm.kernels import store_kv as sk  # noqa: E402
from minivllm.kernels import w4a16_gemm as w4  # noqa: E402
from minivllm.kernels.pdl import pdl_args  # noqa: E402

# kernel -> (constexprs beyond the defaults, pointer dtypes by name (default bf16), num_warps)
CASES = {
    "dense_gemv": (dg._dense_gemv_kernel, dict(HAS_BIAS=False, EVEN_K=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=4,
                                               PREFETCH=512, LINE=64), {"ws_ptr": "fp32", "cnt_ptr": "i32"}, 4),
    "dense_gemv_stream": (dg._dense_gemv_stream_kernel, dict(HAS_BIAS=True, BLOCK_N=2, K_PAD=2048), {}, 4),
    "w4a16_gemv": (w4._w4a16_gemv_kernel, dict(GROUP=128, BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, HALF2=True, EVEN=True),
                   {"x_ptr": "fp16", "qw_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "out_ptr": "fp16",
                    "ws_ptr": "fp32", "cnt_ptr": "i32"}, 4),
    "w4a16_gemv_pipe": (w4._w4a16_gemv_kernel, dict(GROUP=128, BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, HALF2=True,
                                                     EVEN=True, PIPE=True),
                        {"x_ptr": "fp16", "qw_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "out_ptr": "fp16",
                         "ws_ptr": "fp32", "cnt_ptr": "i32"}, 4),
    "w4a16_gemv_xpair": (w4._w4a16_gemv_kernel, dict(GROUP=128, BLOCK_N=32, BLOCK_K=512, SPLIT_K=1, HALF2=True,
                                                      EVEN=True, PIPE=True, XPAIR=True),
                           {"x_ptr": "fp16", "qw_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "out_ptr": "fp16",
                            "ws_ptr": "fp32", "cnt_ptr": "i32"}, 4),
    "w4a16_gemv_pairs": (w4._w4a16_gemv_kernel, dict(GROUP=128, BLOCK_N=32, BLOCK_K=512, SPLIT_K=1, HALF2=True,
                                                      EVEN=True, PIPE=True, XPAIR=True, SZ_PAIRS=True),
                        {"x_ptr": "fp16", "qw_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "out_ptr": "fp16",
                         "ws_ptr": "fp32", "cnt_ptr": "i32"}, 4),
    "moe_up": (fm._moe_decode_up_kernel, dict(HAS_STATS=True, HAS_VALID=False, BLOCK_N=2, BLOCK_K=1024),
               {"ids_ptr": "i32", "stats_ptr": "i64", "valid_ptr": "i32"}, 8),
    "moe_down": (fm._moe_decode_down_kernel, dict(TOP_K=8, BLOCK_N=32, BLOCK_K=256, PREFETCH=256),
                 {"ids_ptr": "i32", "weights_ptr": "fp32", "ws_ptr": "fp32", "cnt_ptr": "i32"}, 8),
    "moe_up_stream": (fm._moe_up_stream_kernel, dict(TOP_K=8, K_PAD=8, HAS_STATS=True, HAS_VALID=False, BLOCK_N=2,
                                                     H_PAD=2048), {"ids_ptr": "i32", "stats_ptr": "i64",
                                                                   "valid_ptr": "i32"}, 8),
    "moe_down_stream": (fm._moe_down_stream_kernel, dict(TOP_K=8, K_PAD=8, BLOCK_N=8, I_PAD=1024),
                        {"ids_ptr": "i32", "weights_ptr": "fp32"}, 8),
    "topk": (fm._topk_softmax_kernel, dict(E=128, E_PAD=128, TOP_K=8, K_PAD=8, RENORM=True),
             {"weights_ptr": "fp32", "ids_ptr": "i32"}, 1),
    "rms_norm": (fo._rms_norm_kernel, dict(H=2048, BLOCK=2048, ROWS=1, HAS_RESIDUAL=True), {"scale_ptr": "fp32"}, 8),
    "rotary": (fo._rotary_kernel, dict(HALF=64, HALF_PAD=64, ROWS=16, NORM=True),
               {"pos_ptr": "i64", "cs_ptr": "fp32"}, 4),
    "rotary_store_kv": (sk._rotary_store_kv_kernel, dict(HALF=64, HALF_PAD=64, ROWS=16, NORM=True, BLOCK_SIZE=16,
                                                         KV_FP8=True),
                        {"pos_ptr": "i64", "cs_ptr": "fp32", "k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv",
                         "slot_ptr": "i64", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}, 4),
    "silu_mul": (fo._silu_and_mul_kernel, dict(I=768, BLOCK=1024), {}, 2),
    "silu_mul_fp8": (fa._silu_mul_quant_kernel, dict(BLOCK=1024, FP8_MAX=448.0, MIN_S=1e-12),
                     {"q_ptr": "fp8e4nv", "s_ptr": "fp32"}, 2),
    "store_kv": (sk._store_kv_kernel, dict(NUM_KV_HEADS=4, HEAD_DIM=128, BLOCK_SIZE=16, H_PAD=4, D_PAD=128,
                                           KV_FP8=False), {"slot_ptr": "i64", "k_scale_ptr": "fp32",
                                                           "v_scale_ptr": "fp32"}, 4),
    "decode_split": (da._decode_split_kernel, dict(GROUP=8, G_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16,
                                                   BLOCK_N=32, MIN_CHUNK_N=64, NUM_SPLITS_IS_ONE=False,
                                                   KV_FP8=False, IEEE=False),
                     {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "qsl_ptr": "i32", "seq_lens_ptr": "i32",
                      "block_tables_ptr": "i32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}, 4),
    "decode_split_merge": (da._decode_split_kernel, dict(GROUP=4, G_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16,
                                                         BLOCK_N=128, MIN_CHUNK_N=128, NUM_SPLITS_IS_ONE=False,
                                                         KV_FP8=False, IEEE=False, MERGE=True, S_PAD=64),
                           {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "qsl_ptr": "i32", "seq_lens_ptr": "i32",
                            "block_tables_ptr": "i32", "cnt_ptr": "i32", "k_scale_ptr": "fp32",
                            "v_scale_ptr": "fp32"}, 4),
    "decode_split_skip": (da._decode_split_kernel, dict(GROUP=4, G_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16,
                                                        BLOCK_N=128, MIN_CHUNK_N=128, NUM_SPLITS_IS_ONE=False,
                                                        KV_FP8=False, IEEE=False, MERGE=True, S_PAD=64,
                                                        SKIP_EMPTY=True),
                          {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "qsl_ptr": "i32", "seq_lens_ptr": "i32",
                           "block_tables_ptr": "i32", "cnt_ptr": "i32", "k_scale_ptr": "fp32",
                           "v_scale_ptr": "fp32"}, 4),
    "decode_merge": (da._decode_merge_kernel, dict(HEAD_DIM=128, D_PAD=128, S_PAD=8),
                     {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "qsl_ptr": "i32"}, 4),
}
# loads allowed before the wait: (kernel, regex of the PTX opcode)
EARLY_LOADS = {"moe_down": r"ld\.global\.cg",
               "dense_gemv_stream": r"ld\.global\.cg",  # (the first weight tile, in registers)
               "w4a16_gemv_pipe": r"ld\.global\.cg",  # (the first K step's words, scales, zeros)
               "w4a16_gemv_xpair": r"ld\.global\.cg",  # (the same, with the activation pairs loaded as words)
               "w4a16_gemv_pairs": r"ld\.global\.cg",  # (the same, each scale and zero one word)
               "decode_split_skip": r"ld\.global\.cg"}  # (the step's metadata: qsl, seq_lens)


def _compile(name: str, pdl: bool):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, consts, ptr_types, warps = CASES[name]
    consts = dict(consts, PDL=pdl)
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            if p.name not in consts:
                assert p.has_default, f"{name}: give {p.name}"
                consts[p.name] = p.default
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*" + ptr_types.get(p.name, "bf16")
        else:
            sig[p.name] = "fp32" if p.name in ("eps", "qk_scale") else "i32"
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={})
    except TypeError as e:  # another Triton's ASTSource
        pytest.skip(f"this Triton's ASTSource differs: {e}")
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 3, "launch_pdl": pdl})


def _body(ptx: str) -> list[str]:
    """The kernel's instructions, in text order (comments and directives dropped)."""
    lines = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if line and not line.startswith((".", "{", "}", "$")) and not line.endswith(":"):
            lines.append(line)
    return lines


@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_access_waits_for_the_previous_kernel(name):
    body = _body(_compile(name, pdl=True).asm["ptx"])
    waits = [i for i, s in enumerate(body) if s.startswith("griddepcontrol.wait")]
    assert waits, f"{name}: no griddepcontrol.wait"
    assert any(s.startswith("griddepcontrol.launch_dependents") for s in body)
    early = [s for s in body[:waits[0]]
             if re.match(r"(@%p\d+ )?(ld\.global|st\.global|atom|red\.)", s)]
    allowed = EARLY_LOADS.get(name)
    bad = [s for s in early if not (allowed and re.match(rf"(@%p\d+ )?{allowed}", s))]
    assert not bad, f"{name}: memory access before the PDL wait: {bad[:3]}"
    # the weights stream before the wait
    if name in ("dense_gemv", "w4a16_gemv", "moe_down"):
        assert any("prefetch.global.L2" in s for s in body[:waits[0]]), f"{name}: no weight prefetch"


@pytest.mark.parametrize("name", ["dense_gemv", "moe_down", "rms_norm"])
def test_without_pdl_no_grid_dependency_control(name):
    ptx = _compile(name, pdl=False).asm["ptx"]
    assert "griddepcontrol" not in ptx and "prefetch.global" not in ptx


def test_pdl_is_off_away_from_cuda(monkeypatch):
    assert pdl_args(torch.zeros(1)) == {"PDL": False}  # CPU tensor (and Triton's interpreter): no launch_pdl
    monkeypatch.setenv("MINIVLLM_PDL", "0")
    assert pdl_args(torch.zeros(1)) == {"PDL": False}
