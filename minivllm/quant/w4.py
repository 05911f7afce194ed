"""4-bit weights in plain PyTorch: the checkpoint layouts, the engine's own layout, and the
dequantizing reference every W4A16 kernel is tested against.

The engine's layout (every checkpoint format is converted to it after loading):

    qweight [K/8, N] int32   nibble p (bits 4p..4p+3) of word [r, n] = q[8r + ENGINE_ORDER[p], n],
                             q in 0..15 (pack_engine / unpack_engine)
    scales  [K/G, N]         float (the model dtype)
    zeros   [K/G, N]         float, the unsigned zero point (8 for symmetric schemes)
                             (on a GPU, 16-bit scales and zeros are the two halves of one
                             [K/G, N, 2] tensor, strided views of it: interleave_scale_zero)
    perm    [K] int64 | None act-order: row i of qweight is input feature perm[i]; rows are
                             sorted by group, so row i belongs to group i // G

    W[n, perm[i]] = (q[i, n] - zeros[i // G, n]) * scales[i // G, n];   y = x @ W.T = x[:, perm] @ Wq

ENGINE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7) interleaves the rows of a word so that its nibbles p and
p + 4 (the two halves of `(word >> 4p) & 0x000F000F`, which the GEMV's packed 16-bit math turns
into one pair of weights with a single LOP3) hold the adjacent rows 2p and 2p + 1: their two
activations are then one aligned 32-bit load of x, not two loads and a repack per word
(kernels/w4a16_gemm.py, _w4a16_gemv_kernel).

Checkpoint layouts (N = output features, K = input features, G = group size):
    AutoAWQ  qweight [K, N/8] int32 packed along N in AWQ's interleaved order (nibble i holds
             column AWQ_ORDER[i] of each 8), qzeros [K/G, N/8] the same way, scales [K/G, N]
    GPTQ     qweight [K/8, N] (our layout), qzeros [K/G, N/8] packed along N in order (v1
             checkpoints store zero - 1), scales [K/G, N], g_idx [K] (group of each input row)
    compressed-tensors pack-quantized: weight_packed [N, K/8] packed along K in order, values
             stored as q + 8 (signed q), weight_scale [N, K/G], weight_zero_point [N/8, K/G]
             (asymmetric only; packed along N, stored as z + 8), weight_g_idx [K] (act-order)
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
ENGINE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an engine word holds row ENGINE_ORDER[p] of its 8


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words packed along `dim`, nibble j = element 8w + j -> int32 values 0..15, 8x as long on dim."""
    p = packed.movedim(dim, -1).to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=p.device)
    vals = (p.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]
    return vals.flatten(-2).movedim(-1, dim)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of unpack_int4: values 0..15 (any int dtype), length on `dim` a multiple of 8."""
    v = values.movedim(dim, -1).to(torch.int64)
    assert v.shape[-1] % 8 == 0, v.shape
    v = v.reshape(*v.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    words = (v << shifts).sum(-1)  # < 2^32: fits int64, then wraps into int32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim)


def _take8(t: torch.Tensor, dim: int, index) -> torch.Tensor:
    """t with every run of 8 elements along `dim` reordered: element j of a run becomes the run's element index[j]."""
    dim %= t.dim()
    runs = t.unflatten(dim, (-1, 8))
    return runs.index_select(dim + 1, torch.tensor(index, device=t.device)).flatten(dim, dim + 1)


def pack_int4_ordered(values: torch.Tensor, dim: int, order) -> torch.Tensor:
    """pack_int4 with the nibbles interleaved: nibble p of a word holds element order[p] of its 8."""
    return pack_int4(_take8(values, dim, order), dim)


def unpack_int4_ordered(packed: torch.Tensor, dim: int, order) -> torch.Tensor:
    """Inverse of pack_int4_ordered: values 0..15 in element order, 8x as long on dim."""
    return _take8(unpack_int4(packed, dim), dim, [order.index(e) for e in range(8)])


def pack_engine(values: torch.Tensor) -> torch.Tensor:
    """[K, N] values 0..15 -> the engine's qweight [K/8, N] int32 (row ENGINE_ORDER[p] of each 8 in nibble p)."""
    return pack_int4_ordered(values, 0, ENGINE_ORDER)


def unpack_engine(qweight: torch.Tensor) -> torch.Tensor:
    """The engine's qweight [K/8, N] int32 -> [K, N] int32 values 0..15, rows in order."""
    return unpack_int4_ordered(qweight, 0, ENGINE_ORDER)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ [R, N/8] int32 -> [R, N] values 0..15 in column order."""
    return unpack_int4_ordered(packed, 1, AWQ_ORDER)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] values 0..15 -> AWQ [R, N/8] int32 (column AWQ_ORDER[i] of each 8 in nibble i)."""
    return pack_int4_ordered(values, 1, AWQ_ORDER)


def group_perm(g_idx: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor | None:
    """Act-order: the row order that makes groups contiguous (None when g_idx is already i // G).
    Raises ValueError if the groups do not all hold group_size rows (the kernels assume it)."""
    g = g_idx.to(torch.int64)
    if torch.equal(g, torch.arange(in_features, device=g.device) // group_size):
        return None
    counts = torch.bincount(g, minlength=in_features // group_size)
    if counts.numel() != in_features // group_size or bool((counts != group_size).any()):
        raise ValueError(f"g_idx does not give every group {group_size} rows (counts {counts.unique().tolist()})")
    return torch.argsort(g, stable=True)


def interleave_scale_zero(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit scales and zeros [K/G, N] -> the same values as views of one [K/G, N, 2] tensor
    (strides (2N, 2), the zero 2 bytes after its scale): each column's pair is one aligned 32-bit
    word, which the batch-1 GEMV reads with one load instead of two tiles (lease 50's probe: the
    two tiles cost a layer's four GEMVs 4.7 us more than the pairs). Other dtypes: returned as given."""
    if scales.element_size() != 2 or zeros.dtype != scales.dtype:
        return scales, zeros
    both = torch.stack([scales, zeros], dim=-1).contiguous()  # [K/G, N, 2]
    return both[..., 0], both[..., 1]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               perm: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The engine's layout -> W [N, K] in `dtype` (computed in float32), input features in their
    original order: the reference."""
    q = unpack_engine(qweight).float()  # [K, N]
    k = q.shape[0]
    g = torch.arange(k, device=q.device) // (k if group_size == -1 else group_size)
    w = (q - zeros.float()[g]) * scales.float()[g]  # [K, N], rows in stored order
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm, w)
    return w.t().contiguous().to(dtype)


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(...).T (+ bias) in float32, returned in x's dtype."""
    w = dequantize(qweight, scales, zeros, group_size, perm)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
