"""The W4 tile format of the persistent decode kernel (kernels/cuda/w4_tile.cuh), in PyTorch.

A weight in the engine's layout (quant/w4.py: qweight [K/8, N], scales and zeros [K/G, N], G = 128)
becomes N/16 x K/2048 tiles of 16 output rows x 2,048 k, tile (rt, kc) at rt * (K/2048) + kc, each
TILE_WORDS int32 words:

    words [8 warps][16 k steps][32 lanes]: lane l holds rows r = l // 4 and r + 8 of the tile and
          k = 2048 kc + 256 warp + 16 step + 2 (l % 4) + {0, 1, 8, 9}; nibble p = 4e + 2h + s
          (bits 4p..4p+3) holds row r + 8s, k + e + 8h (the m16n8k16 A fragment, one LOP3 from
          a register pair of 1024 + q)
    then  [16 rows][16 groups] half2 {scale, 1024 + zero} as int32 (scale in the low half)

`row_order` puts the weight's rows (output features) in another order first: the layer tail pairs
gate row i with up row i in one tile (gate_up_row_order), and a head's rows d and d + D/2 for the
rotary (rope_row_order). `from_tiles` reads a tile tensor back
(the tests' inverse); `tile_matvec_reference` is the product the kernel computes, in float32.
"""

from __future__ import annotations

import torch

from minivllm.quant.w4 import dequantize, pack_engine, pack_int4, unpack_engine, unpack_int4

TILE_ROWS = 16
TILE_K = 2048
TILE_GROUP = 128
TILE_WORDS = TILE_ROWS * TILE_K // 8 + TILE_ROWS * TILE_K // TILE_GROUP  # 4,096 + 256 = 4,352 (17,408 bytes)
# (rt, kc, warp, step, r, q, e, h, s) <- the [R, K] values viewed as (rt, s, r, kc, warp, step, h, q, e)
_WORD_ORDER = (0, 3, 4, 5, 2, 7, 8, 6, 1)
_ROWTILES_AT_ONCE = 128  # bounds the int64 temporaries of a repack (~70 MB at k = 4,096)


def tiles_fit(rows: int, k: int, group_size: int) -> bool:
    """Whether a weight of `rows` outputs and `k` inputs can take the tile format."""
    return group_size == TILE_GROUP and k % TILE_K == 0 and rows % TILE_ROWS == 0 and rows > 0


def gate_up_row_order(intermediate: int, device: torch.device | None = None) -> torch.Tensor:
    """Rows of a [gate; up] weight (2I outputs) so that tile j holds gate rows 8j..8j+7 then up
    rows 8j..8j+7: the kernel's SwiGLU output i then comes from one tile."""
    idx = torch.arange(intermediate, device=device).view(-1, 8)
    return torch.cat([idx, idx + intermediate], dim=1).reshape(-1)


def tile_bytes(rows: int, k: int) -> int:
    """The bytes of a weight of `rows` outputs and `k` inputs in the tile format."""
    return (rows // TILE_ROWS) * (k // TILE_K) * TILE_WORDS * 4


def rope_row_order(heads: int, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Rows of a qkv weight of `heads` heads (q, k and v together) so that tile t holds rows
    8j..8j+7 of head t // (D/16) (j = t % (D/16)) then the same rows + D/2: the pairs the rotary
    mixes (neox halves) sit in one tile, so the kernel's epilogue rotates them (OUT_QKV)."""
    assert head_dim % TILE_ROWS == 0, head_dim
    idx = torch.arange(heads * head_dim, device=device).view(heads, 2, head_dim // TILE_ROWS, 8)
    return idx.permute(0, 2, 1, 3).reshape(-1)  # (head, j, half, i) <- row head D + half D/2 + 8j + i


def _fp16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def to_tiles(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             row_order: torch.Tensor | None = None) -> torch.Tensor:
    """Engine layout (qweight [K/8, N] int32, scales / zeros [K/128, N]) -> int32 [N/16 * K/2048 *
    TILE_WORDS] tiles, rows taken in row_order (default: 0..N-1). Runs where the weight lives."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    assert tiles_fit(n, k, k // scales.shape[0]) and scales.shape == zeros.shape == (k // TILE_GROUP, n), \
        (qweight.shape, scales.shape)
    rowtiles, kchunks = n // TILE_ROWS, k // TILE_K
    out = torch.empty(rowtiles, kchunks, TILE_WORDS, dtype=torch.int32, device=qweight.device)
    # [K/G, N] int32: 1024 + z (0..15) in fp16 is 0x6400 + z, so the high half never sets bit 31
    sz = _fp16_bits(scales) | (_fp16_bits(zeros.float() + 1024.0) << 16)
    for r0 in range(0, rowtiles, _ROWTILES_AT_ONCE):
        r1 = min(rowtiles, r0 + _ROWTILES_AT_ONCE)
        rows = torch.arange(r0 * TILE_ROWS, r1 * TILE_ROWS, device=qweight.device)
        if row_order is not None:
            rows = row_order[rows]
        q = unpack_engine(qweight[:, rows]).t()  # [R, K] values 0..15
        q = q.reshape(r1 - r0, 2, 8, kchunks, 8, 16, 2, 4, 2).permute(*_WORD_ORDER)
        # the last dim (e, h, s) is nibble p = 4e + 2h + s: pack_int4's order along it
        out[r0:r1, :, :TILE_WORDS - 256] = pack_int4(q.reshape(r1 - r0, kchunks, 8 * (TILE_WORDS - 256)), -1)
        s = sz[:, rows].t().reshape(r1 - r0, TILE_ROWS, kchunks, TILE_K // TILE_GROUP).permute(0, 2, 1, 3)
        out[r0:r1, :, TILE_WORDS - 256:] = s.reshape(r1 - r0, kchunks, 256)
    return out.reshape(-1)


def from_tiles(tiles: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of to_tiles: -> (q [K, N] int32 0..15, scales [K/128, N] float16, zeros [K/128, N]
    float32), rows in the tiles' order."""
    rowtiles, kchunks = n // TILE_ROWS, k // TILE_K
    t = tiles.view(rowtiles, kchunks, TILE_WORDS)
    nib = unpack_int4(t[..., :TILE_WORDS - 256], -1)  # nibble p = 4e + 2h + s of each word, in order
    nib = nib.reshape(rowtiles, kchunks, 8, 16, 8, 4, 2, 2, 2)  # rt, kc, warp, step, r, q, e, h, s
    inverse = [_WORD_ORDER.index(d) for d in range(9)]
    q = nib.permute(*inverse).reshape(n, k).t().to(torch.int32)
    sz = t[..., TILE_WORDS - 256:].to(torch.int64).reshape(rowtiles, kchunks, TILE_ROWS, 16).permute(0, 2, 1, 3)
    sz = sz.reshape(n, -1)
    scales = (sz & 0xFFFF).to(torch.int16).view(torch.float16).t()
    zeros = ((sz >> 16).to(torch.int16).view(torch.float16).float() - 1024.0).t()
    return q.contiguous(), scales.contiguous(), zeros.contiguous()


def tile_matvec_reference(tiles: torch.Tensor, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x [k] -> [n] float32: (q - z) * s of the tiles times x, in float32 (the kernel's product
    up to float32 rounding; its rows in the tiles' order)."""
    q, scales, zeros = from_tiles(tiles, n, k)
    return x.float() @ dequantize(pack_engine(q), scales, zeros, TILE_GROUP).t()
