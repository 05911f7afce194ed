"""CPU float32 fast paths of the layers against the plain torch math they replace."""

import pytest
import torch

from minivllm.kernels.fused_ops import apply_rotary_torch, fused_add_rms_norm, rms_norm
from minivllm.models.layers import RotaryEmbedding


def _reference_rms_norm(x, weight, eps):  # the eight-op math (HF's order), as in rms_norm_torch
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (33, 960), (5, 9, 64)])
def test_cpu_rms_norm_is_bit_identical(shape):
    torch.manual_seed(shape[0])
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    assert torch.equal(rms_norm(x, w, 1e-5), _reference_rms_norm(x, w, 1e-5))
    r = torch.randn(shape)
    y, s = fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r) and torch.equal(y, _reference_rms_norm(x + r, w, 1e-5))


def test_cpu_rms_norm_keeps_the_upcast_for_bf16():
    torch.manual_seed(0)
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), _reference_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("tokens", [1, 6])
def test_rotate_qk_cpu_is_bit_identical_and_tracks_positions(tokens):
    torch.manual_seed(tokens)
    rot = RotaryEmbedding(64, 512, 10000.0, None)
    hq, hk = 9, 3
    for start in (0, 300):  # a new positions tensor (the next step) must not reuse cos/sin
        positions = torch.arange(start, start + tokens)
        qk = torch.randn(tokens, hq + hk, 64)
        q_ref, k_ref = apply_rotary_torch(positions, qk[:, :hq], qk[:, hq:], rot.cos_sin)
        out = rot.rotate_qk_cpu(positions, qk)
        assert torch.equal(out[:, :hq], q_ref) and torch.equal(out[:, hq:], k_ref)
