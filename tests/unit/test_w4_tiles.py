"""The W4 tile format of the persistent layer tail (quant/w4_tiles.py) on the CPU: the repack from
the engine's layout is exact and invertible, pairs gate and up rows as the kernel's SwiGLU reads
them, and its product equals the dequantized reference. The kernel itself: tests/gpu/test_w4_layer_tail.py.
"""

from __future__ import annotations

import subprocess
import types

import pytest
import torch

from minivllm.kernels import w4_layer_tail as lt
from minivllm.quant import w4
from minivllm.quant import w4_tiles as tiles


def _weight(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(k // 128, n, generator=gen) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 16, (k // 128, n), generator=gen).half()
    return q, w4.pack_engine(q), scales, zeros


@pytest.mark.parametrize("n,k", [(16, 2048), (48, 4096), (160, 6144)])
def test_tiles_round_trip(n: int, k: int) -> None:
    q, qw, scales, zeros = _weight(n, k)
    t = tiles.to_tiles(qw, scales, zeros)
    assert t.dtype == torch.int32 and t.numel() == (n // 16) * (k // 2048) * tiles.TILE_WORDS
    q2, s2, z2 = tiles.from_tiles(t, n, k)
    assert torch.equal(q2, q.to(torch.int32)) and torch.equal(s2, scales) and torch.equal(z2, zeros.float())


def test_tiles_with_interleaved_scale_zero_views() -> None:
    """The GPU loader's scales and zeros are strided views of one pair tensor: same tiles."""
    _, qw, scales, zeros = _weight(32, 2048, seed=1)
    s, z = w4.interleave_scale_zero(scales, zeros)
    assert s.stride(-1) == 2
    assert torch.equal(tiles.to_tiles(qw, s, z), tiles.to_tiles(qw, scales, zeros))


def test_word_layout_is_the_mma_fragment() -> None:
    """Nibble p = 4e + 2h + s of lane l's word (warp w, step m) holds row l // 4 + 8s and
    k = 256w + 16m + 2(l % 4) + e + 8h: checked on one word of a weight whose value encodes its own
    position, (row + k) mod 16."""
    n, k = 16, 2048
    rows, cols = torch.arange(n)[None, :], torch.arange(k)[:, None]
    q = (rows + cols) % 16  # [K, N]
    t = tiles.to_tiles(w4.pack_engine(q), torch.ones(16, n).half(), torch.zeros(16, n).half())
    warp, step, lane = 3, 5, 13
    word = int(t[warp * 512 + step * 32 + lane]) & 0xFFFFFFFF
    r, kk = lane // 4, 256 * warp + 16 * step + 2 * (lane % 4)
    for p in range(8):
        e, h, s = p // 4, (p // 2) % 2, p % 2
        assert (word >> (4 * p)) & 0xF == (r + 8 * s + kk + e + 8 * h) % 16, p
    sz = int(t[4096 + 3 * 16 + 7]) & 0xFFFFFFFF  # row 3, group 7: {scale 1.0, 1024 + 0}
    assert sz & 0xFFFF == 0x3C00 and sz >> 16 == 0x6400


def test_gate_up_row_order_pairs_each_tile() -> None:
    order = tiles.gate_up_row_order(32)
    assert sorted(order.tolist()) == list(range(64))
    for j in range(4):  # tile j: gate 8j..8j+7, then up 8j..8j+7
        assert order[16 * j:16 * j + 8].tolist() == list(range(8 * j, 8 * j + 8))
        assert order[16 * j + 8:16 * j + 16].tolist() == list(range(32 + 8 * j, 32 + 8 * j + 8))
    _, qw, scales, zeros = _weight(64, 2048, seed=2)
    q2, s2, _ = tiles.from_tiles(tiles.to_tiles(qw, scales, zeros, order), 64, 2048)
    assert torch.equal(q2, w4.unpack_engine(qw)[:, order]) and torch.equal(s2, scales[:, order])


def test_tile_product_matches_the_dequantized_reference() -> None:
    _, qw, scales, zeros = _weight(96, 4096, seed=3)
    x = torch.randn(4096)
    ref = x @ w4.dequantize(qw, scales, zeros, 128).t()
    out = tiles.tile_matvec_reference(tiles.to_tiles(qw, scales, zeros), x, 96, 4096)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_tiles_fit() -> None:
    assert tiles.tiles_fit(4096, 14336, 128) and tiles.tiles_fit(16, 2048, 128)
    assert not tiles.tiles_fit(576, 576, 64)  # the default model: the unfused path
    assert not tiles.tiles_fit(4096, 4096, 64) and not tiles.tiles_fit(4104, 4096, 128)


def _layer(**over):
    lin = dict(method=None, qweight=torch.zeros(1), perm=None, bias=None, scales=torch.zeros(1, dtype=torch.float16),
               in_features=4096, out_features=4096, group_size=128)
    attn = types.SimpleNamespace(tp=None, o_proj=types.SimpleNamespace(**lin))
    mlp = types.SimpleNamespace(tp=None, gate_up_proj=types.SimpleNamespace(**lin),
                                down_proj=types.SimpleNamespace(**lin))
    norm = types.SimpleNamespace(fp8_out=False, weight=torch.ones(4, dtype=torch.float16))
    layer = types.SimpleNamespace(is_moe=False, self_attn=attn, mlp=mlp, post_attention_layernorm=norm)
    for key, value in over.items():
        setattr(layer, key, value)
    return layer


def test_why_not_eligible_names_the_reason() -> None:
    assert lt.why_not_eligible(_layer(is_moe=True)) == "MoE layer"
    tp_layer = _layer()
    tp_layer.self_attn.tp = object()
    assert lt.why_not_eligible(tp_layer) == "tensor parallelism"
    assert "not a W4A16 layer" in lt.why_not_eligible(_layer())  # a plain namespace is no W4A16Method
    bf16 = _layer()
    bf16.post_attention_layernorm.weight = torch.ones(4, dtype=torch.bfloat16)
    assert "bfloat16" in lt.why_not_eligible(bf16)


def test_switch_is_auto_by_default(monkeypatch) -> None:
    monkeypatch.delenv("MINIVLLM_W4_LAYER_TAIL", raising=False)
    assert lt.mode() == "auto"
    for value, expected in (("1", "1"), ("0", "0"), ("auto", "auto"), ("yes", "auto")):
        monkeypatch.setenv("MINIVLLM_W4_LAYER_TAIL", value)
        assert lt.mode() == expected


def test_auto_mode_needs_an_eligible_layer_nvcc_and_room(monkeypatch) -> None:
    """why_not_auto: no eligible layer, no nvcc, tiles over 10 % of the engine's memory -> a reason;
    else None. eligible_layers keeps the eligible layers; planned_tile_bytes counts every tileable
    projection's tiles (17,408 bytes each)."""
    layer = _layer()
    layer.self_attn.qkv_proj = types.SimpleNamespace(in_features=4096, out_features=6144)
    monkeypatch.setattr(lt, "why_not_eligible", lambda lay: None if lay is layer else "no")
    model = types.SimpleNamespace(layers=[layer, object()])
    monkeypatch.setattr(lt, "_tileable", lambda lin: None)
    per_layer = sum((lin.out_features // 16) * (lin.in_features // 2048) * 17408
                    for lin in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                                layer.self_attn.qkv_proj))
    assert lt.eligible_layers(model) == [layer]
    assert lt.planned_tile_bytes([layer]) == per_layer > 0
    monkeypatch.setattr(lt, "find_nvcc", lambda: None)
    assert "nvcc" in lt.why_not_auto(model)
    monkeypatch.setattr(lt, "find_nvcc", lambda: "/usr/bin/nvcc")
    memory = {"total_memory": 0}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(**memory))
    memory["total_memory"] = per_layer * 9  # the tiles 11 % of it
    assert "over 10%" in lt.why_not_auto(model)
    memory["total_memory"] = per_layer * 11
    assert lt.why_not_auto(model) is None
    assert "over 10%" in lt.why_not_auto(model, memory_share=0.5)  # the engine's share of the GPU
    assert lt.why_not_auto(types.SimpleNamespace(layers=[object()])) == lt.NO_ELIGIBLE_LAYER == "no eligible layer"


def test_cooperative_launch_is_on_by_default(monkeypatch) -> None:
    monkeypatch.delenv("MINIVLLM_W4_TAIL_COOP", raising=False)
    assert lt.coop_on()
    monkeypatch.setenv("MINIVLLM_W4_TAIL_COOP", "0")
    assert not lt.coop_on()


def test_runner_serves_without_the_tail_when_it_cannot_be_built(monkeypatch, caplog) -> None:
    """MINIVLLM_W4_LAYER_TAIL=1 where the kernel cannot be built: a warning, and the model is left
    as it was (the unfused path serves)."""
    from minivllm.runner.model_runner import ModelRunner

    def no_nvcc(model):
        raise RuntimeError("needs nvcc")
    monkeypatch.setenv("MINIVLLM_W4_LAYER_TAIL", "1")
    monkeypatch.setattr(lt, "attach_layer_tails", no_nvcc)
    model = types.SimpleNamespace(layers=[], tail_chain=False)
    with caplog.at_level("WARNING"):
        ModelRunner._attach_w4_layer_tails(types.SimpleNamespace(lora=None), model)
    assert "W4 layer tail unavailable" in caplog.text and "needs nvcc" in caplog.text
    assert model.tail_chain is False


def _lin(n: int, k: int, seed: int):
    _, qw, scales, zeros = _weight(n, k, seed)
    return types.SimpleNamespace(qweight=qw, scales=scales, zeros=zeros, in_features=k, out_features=n)


def test_layer_tail_module_holds_each_weight_as_tiles() -> None:
    """W4LayerTail's buffers (built on the CPU here): o, gate_up with gate and up rows paired per
    tile, down and, chained, qkv; nothing is launched."""
    q, h, inter = 2048, 2048, 4096
    o, gu, down, qkv = _lin(h, q, 1), _lin(2 * inter, h, 2), _lin(h, inter, 3), _lin(q + 1024, h, 4)
    counters = torch.zeros(lt.MAX_STAGES + 1, dtype=torch.int32)
    tail = lt.W4LayerTail(o, gu, down, torch.ones(h, dtype=torch.float16), 1e-5, counters, 264, qkv,
                          torch.ones(h, dtype=torch.float16), kmax=14336, heads=(16, 4, 128))
    assert (tail.q_size, tail.hidden, tail.intermediate, tail.qkv_rows, tail.kmax) == (q, h, inter, q + 1024, 14336)
    assert torch.equal(tail.o_tiles, tiles.to_tiles(o.qweight, o.scales, o.zeros))
    q_gu, _, _ = tiles.from_tiles(tail.gu_tiles, 2 * inter, h)
    assert torch.equal(q_gu, w4.unpack_engine(gu.qweight)[:, tiles.gate_up_row_order(inter)])
    # qkv's tiles pair each head's rows d and d + 64 (the rotary's halves) for the OUT_QKV epilogue
    assert torch.equal(tail.qkv_tiles, tiles.to_tiles(qkv.qweight, qkv.scales, qkv.zeros,
                                                      tiles.rope_row_order(24, 128)))
    words = sum(t.numel() for t in (tail.o_tiles, tail.gu_tiles, tail.down_tiles, tail.qkv_tiles))
    assert tail.extra_bytes() == 4 * words
    unchained = lt.W4LayerTail(o, gu, down, torch.ones(h, dtype=torch.float16), 1e-5, counters, 264)
    assert unchained.qkv_tiles is None and unchained.kmax == inter


def test_stage_struct_mirrors_the_kernels() -> None:
    """ctypes' _Stage is w4_layer_tail.cu's FlatStage: 6 pointers, then 5 ints (72 bytes, padded)."""
    import ctypes
    assert [name for name, _ in lt._Stage._fields_] == ["tiles", "in0", "in1", "norm_w", "res_out", "out", "k",
                                                         "rowtiles", "kchunks", "in_kind", "out_kind"]
    assert ctypes.sizeof(lt._Stage) == 72
    src = open(f"{lt.SOURCE_DIR}/w4_layer_tail.cu").read()
    assert "const void *tiles, *in0, *in1, *norm_w;\n  void *res_out, *out;\n  int k, rowtiles, kchunks, in_kind, out_kind;" in src


def test_rope_struct_mirrors_the_kernels() -> None:
    """ctypes' _Rope is w4_layer_tail.cu's FlatRope: 5 pointers, 3 int64 strides, 6 ints (88 bytes)."""
    import ctypes
    assert [name for name, _ in lt._Rope._fields_] == ["positions", "cos_sin", "slots", "k_cache", "v_cache",
                                                        "stride_block", "stride_slot", "stride_head", "cs_stride",
                                                        "block_size", "q_heads", "kv_heads", "head_dim", "rotate"]
    assert ctypes.sizeof(lt._Rope) == 88
    src = open(f"{lt.SOURCE_DIR}/w4_layer_tail.cu").read()
    assert ("const void *positions, *cos_sin, *slots;\n  void *k_cache, *v_cache;\n  long long stride_block, "
            "stride_slot, stride_head;\n  int cs_stride, block_size, q_heads, kv_heads, head_dim, rotate;") in src


@pytest.mark.parametrize("heads,head_dim", [(1, 16), (3, 64), (48, 128)])
def test_rope_row_order_pairs_the_rotary_halves_in_each_tile(heads: int, head_dim: int) -> None:
    """Tile t's rows i and i + 8 are rows d and d + D/2 of one head, d = 8 (t % (D/16)) + i, in
    head order: the kernel's OUT_QKV epilogue rotates them without leaving the tile."""
    order = tiles.rope_row_order(heads, head_dim)
    assert sorted(order.tolist()) == list(range(heads * head_dim))
    per_head = head_dim // 16
    for t, rows in enumerate(order.view(-1, 16).tolist()):
        head, j = divmod(t, per_head)
        for i in range(8):
            d = 8 * j + i
            assert rows[i] == head * head_dim + d and rows[i + 8] == head * head_dim + d + head_dim // 2


def test_build_without_nvcc_says_so(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(lt, "find_nvcc", lambda: None)
    with pytest.raises(RuntimeError, match="needs nvcc"):
        lt._build(str(tmp_path / "x.so"))


@pytest.mark.skipif(lt.find_nvcc() is None, reason="no nvcc here")
def test_kernel_compiles_without_spills(tmp_path) -> None:
    """Compile-only (no GPU needed): the kernel builds for sm_90a, spill-free, within the register
    budget of two blocks an SM (288 threads each: 113 registers)."""
    out = subprocess.run([lt.find_nvcc(), "-O3", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                          "-o", str(tmp_path / "k.cubin"), f"{lt.SOURCE_DIR}/w4_layer_tail.cu"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    info = out.stderr
    assert "0 bytes spill stores" in info
    regs = int(info.split("Used ")[1].split(" registers")[0])
    assert regs <= 113
