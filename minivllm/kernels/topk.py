"""The router's top-k of one token's logits, as a Triton helper shared by the top-k kernel
(kernels/fused_moe.py) and the router GEMV that finishes with it (kernels/dense_gemv.py)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference paths never reach these
    triton = tl = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def topk_row(x, cols, weights_ptr, ids_ptr, E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
             K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """x [E_PAD] float32 logits (-inf past E), cols = arange(E_PAD): softmax over E in fp32, the
    TOP_K largest by repeated argmax (ties: the lowest expert id), optionally renormalised, stored
    to weights_ptr[0..TOP_K) (float32) and ids_ptr[0..TOP_K) (int32) with one vector store each."""
    ks = tl.arange(0, K_PAD)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(cols < E, p, -1.0)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, E_PAD), axis=0)
        ids = tl.where(ks == j, idx, ids)
        w = tl.where(ks == j, best, w)
        p = tl.where(cols == idx, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    tl.store(ids_ptr + ks, ids, mask=ks < TOP_K)
    tl.store(weights_ptr + ks, w, mask=ks < TOP_K)
