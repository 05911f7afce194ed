"""PackedLinear (oneDNN-prepacked CPU weights) against the plain nn.Linear it replaces."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from minivllm.models.cpu_linear import MIN_PACKED_ROWS, PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS - 1, MIN_PACKED_ROWS, 7, 32, 129])
def test_packed_matches_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(1536, 576, bias=bias)
    x = torch.randn(rows, 1536)
    packed = PackedLinear(lin)
    with torch.inference_mode():
        ref, out = lin(x), packed(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_packed_path_is_taken_and_can_differ_from_a_wrong_weight():
    # the packed copy is what runs from MIN_PACKED_ROWS rows: corrupt the plain weight and the
    # packed result must still equal the original layer (and the unpacked path must not)
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=False)
    packed = PackedLinear(lin)
    x_big, x_small = torch.randn(MIN_PACKED_ROWS + 1, 64), torch.randn(1, 64)
    with torch.inference_mode():
        ref_big, ref_small = lin(x_big), lin(x_small)
        packed.weight.data.mul_(2)
        torch.testing.assert_close(packed(x_big), ref_big, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed(x_small), ref_small)


def test_pack_linears_keeps_tied_weights_and_skips_non_fp32():
    model = nn.Module()
    model.embed = nn.Embedding(100, 32)
    model.head = nn.Linear(32, 100, bias=False)
    model.head.weight = model.embed.weight
    model.inner = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32).to(torch.bfloat16))
    assert pack_linears(model) == 2
    assert isinstance(model.head, PackedLinear) and model.head.weight is model.embed.weight
    assert isinstance(model.inner[0], PackedLinear) and type(model.inner[1]) is nn.Linear


@pytest.mark.parametrize("use_kernel", [False, True])
def test_argmax_rows_equals_argmax_of_forward(use_kernel):
    """PackedLinear.argmax_rows: the panel kernel's fused argmax, or forward().argmax(-1) on oneDNN."""
    from minivllm.kernels import cpu_kernels
    ops = cpu_kernels.load() if use_kernel else None
    if use_kernel and (ops is None or ops.packed_panel_width() == 0):
        pytest.skip("no panel kernel in this build")
    if not use_kernel and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    torch.manual_seed(1)
    lin = nn.Linear(40, 300, bias=False)
    packed = PackedLinear(lin, ops=ops)
    for rows in (1, 7, 32):
        x = torch.randn(rows, 40)
        assert torch.equal(packed.argmax_rows(x), packed(x).argmax(-1))
        assert torch.equal(packed.argmax_rows(x), lin(x).argmax(-1))
    if use_kernel:
        with pytest.raises(ValueError, match="argmax_rows"):
            packed.argmax_rows(torch.randn(2, 41))


def test_argmax_rows_through_the_int8_screen(monkeypatch):
    """prepare_screened_argmax gives argmax_rows the int8 screen up to SCREEN_MAX_ROWS rows (the
    exact kernel above): the answers equal forward().argmax(-1) either way. It declines where the
    screen cannot run: in_features not a multiple of 32, MINIVLLM_CPU_SCREENED_ARGMAX=0."""
    from minivllm.kernels import cpu_kernels
    from minivllm.models.cpu_linear import SCREEN_ENV_FLAG, SCREEN_MAX_ROWS
    ops = cpu_kernels.load()
    if ops is None or ops.packed_panel_width() == 0 or not ops.screened_argmax_available():
        pytest.skip("no panel kernel or no int8 screen in this build")
    torch.manual_seed(4)
    packed = PackedLinear(nn.Linear(64, 1000, bias=True), ops=ops)
    assert packed.prepare_screened_argmax() and packed.screen is not None
    calls = []
    screened = ops.screened_argmax
    monkeypatch.setattr(packed, "ops", SimpleNamespace(
        screened_argmax=lambda *a: calls.append(a[0].shape[0]) or screened(*a),
        packed_linear_argmax=ops.packed_linear_argmax, packed_linear=ops.packed_linear))
    for rows in (1, 40, SCREEN_MAX_ROWS, SCREEN_MAX_ROWS + 1):
        x = torch.randn(rows, 64) * 3
        assert torch.equal(packed.argmax_rows(x), packed(x).argmax(-1))
    assert calls == [1, 40, SCREEN_MAX_ROWS]
    assert not PackedLinear(nn.Linear(40, 100), ops=ops).prepare_screened_argmax()
    monkeypatch.setenv(SCREEN_ENV_FLAG, "0")
    assert not PackedLinear(nn.Linear(64, 100), ops=ops).prepare_screened_argmax()


def test_forward_through_affine_blocks(monkeypatch):
    """prepare_affine_blocks on a weight of exact 4-bit affine blocks: forward and silu_mul_rows take
    the affine kernel up to AFFINE_MAX_ROWS rows and give the panel kernel's results bit for bit;
    a random weight, or MINIVLLM_CPU_AFFINE_BLOCKS=0, keeps the panels."""
    from minivllm.kernels import cpu_kernels
    from minivllm.models.cpu_linear import AFFINE_ENV_FLAG, AFFINE_MAX_ROWS
    ops = cpu_kernels.load()
    if ops is None or ops.packed_panel_width() == 0 or not ops.affine_block_linear_available():
        pytest.skip("no panel kernel or no affine-block path in this build")
    p = ops.packed_panel_width()
    lin = nn.Linear(64, 4 * p, bias=True)
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(4 * p * 2, 1, generator=g) * 0.01).half().float()
    q = torch.randint(0, 16, (4 * p * 2, 32), generator=g).float()
    q[:, 0], q[:, 1] = 0, 15
    with torch.no_grad():
        lin.weight.copy_((d * q - 0.03).view(4 * p, 64))
    packed, plain = PackedLinear(lin, ops=ops), PackedLinear(lin, ops=ops)
    assert packed.prepare_affine_blocks() and packed.fuses_silu_mul
    calls = []
    affine = ops.affine_block_linear
    monkeypatch.setattr(packed, "ops", SimpleNamespace(
        affine_block_linear=lambda *a: calls.append(a[0].shape[0]) or affine(*a), silu_mul=ops.silu_mul,
        packed_linear=ops.packed_linear, packed_linear_silu_mul=ops.packed_linear_silu_mul))
    for rows in (1, AFFINE_MAX_ROWS, AFFINE_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        assert torch.equal(packed(x), plain(x))
        assert torch.equal(packed.silu_mul_rows(x), plain.silu_mul_rows(x))
    assert calls == [1, 1, AFFINE_MAX_ROWS, AFFINE_MAX_ROWS]
    assert not PackedLinear(nn.Linear(64, 32), ops=ops).prepare_affine_blocks()
    monkeypatch.setenv(AFFINE_ENV_FLAG, "0")
    assert not PackedLinear(lin, ops=ops).prepare_affine_blocks()


def test_silu_mul_rows_fuses_only_on_whole_panels():
    """gate_up on the panel kernel: silu_mul_rows equals silu_mul(forward(x)); a width whose halves
    do not start on a panel boundary is not fused (and says so), and neither is oneDNN's."""
    from minivllm.kernels import cpu_kernels
    ops = cpu_kernels.load()
    if ops is None or ops.packed_panel_width() == 0:
        pytest.skip("no panel kernel in this build")
    p = ops.packed_panel_width()
    torch.manual_seed(2)
    fused = PackedLinear(nn.Linear(48, 4 * p, bias=True), ops=ops)
    x = torch.randn(9, 48)
    assert fused.fuses_silu_mul
    assert torch.equal(fused.silu_mul_rows(x), ops.silu_mul(fused(x)))
    odd = PackedLinear(nn.Linear(48, 2 * p + 2, bias=False), ops=ops)
    assert not odd.fuses_silu_mul and not PackedLinear(nn.Linear(48, 4 * p)).fuses_silu_mul
    with pytest.raises(ValueError, match="silu_mul_rows"):
        odd.silu_mul_rows(x)
