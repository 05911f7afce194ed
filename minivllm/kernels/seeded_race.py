"""The seeded exponential race of sample/rng.py in one Triton pass per row (GPU).

A seeded row's token is argmax_i(p_i / E_i) with E_i a counter-based hash of (seed, counter, i)
(rng.seeded_exponentials). The torch form builds E as [R, V] int64 and float64 temporaries: ~20
elementwise kernels over V = 151,936 tokens a row, about 320 bytes of memory traffic per token
(an estimate: ~6 GB and ~2 ms a step at W1's ~128 rows). Batch-invariant mode seeds every random
request (models/batch_invariant.py), so W1-bi (temperature 0.6) paid it every step. Here one
program per row computes the same E in registers while it reads p once (4 bytes a token), and
keeps the running argmax; only the winning token id is stored. Measured (H100, lease 23, same
lease): W1-bi 15,529 output tok/s against 12,621 with the torch form (MINIVLLM_SEEDED_RACE_KERNEL=0).

Bit-exact with the torch form: the same uint64 SplitMix64 arithmetic, the same float64 log
rounded to float32, IEEE division (tl.div_rn, as torch's div_), and ties going to the lowest
token id (torch.argmax's first maximum). One difference: a NaN probability never wins here,
while torch.argmax returns a NaN's index (such a row's logits are broken either way). tests/unit/test_seeded_race_interpret.py checks it under
Triton's interpreter, tests/gpu/test_seeded_race.py on the GPU (the noise bit for bit, the ids).
"""

from __future__ import annotations

import torch

from minivllm.kernels.fused_ops import _jit, triton

if triton is not None:
    import triton.language as tl
else:
    tl = None

BLOCK = 1024  # tokens per loop step of a row's program


@_jit
def _splitmix(h):
    """SplitMix64's finalizer on uint64 (>> is logical on unsigned; * wraps mod 2**64)."""
    h = h ^ (h >> 30)
    h = h * 0xBF58476D1CE4E5B9
    h = h ^ (h >> 27)
    h = h * 0x94D049BB133111EB
    return h ^ (h >> 31)


@_jit
def _seeded_race_kernel(probs_ptr, stride_p, rows_ptr, keys_ptr, out_ptr, noise_ptr, V,
                        HAS_ROWS: tl.constexpr, STORE_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row rows[r] (r without HAS_ROWS) of probs, key keys[r] (rng's row key) ->
    out[r] = argmax_i probs[row, i] / E_i (the lowest i among equal maxima). STORE_NOISE (tests):
    E also written to noise[r, :]."""
    r = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    key = tl.load(keys_ptr + r).to(tl.uint64, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float32)  # every score is >= 0
    best_tok = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, V, BLOCK):
        tok = v0 + lanes
        ok = tok < V
        p = tl.load(probs_ptr + row * stride_p + tok, mask=ok, other=0.0)
        h = _splitmix(key + (tok + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        u = ((h >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # (top 52 bits + 0.5) / 2**52
        e = (-tl.log(u)).to(tl.float32)
        if STORE_NOISE:
            tl.store(noise_ptr + r.to(tl.int64) * V + tok, e, mask=ok)
        s = tl.where(ok, tl.div_rn(p, e), -1.0)
        better = s > best  # strict: within a lane the earlier token keeps a tie
        best = tl.where(better, s, best)
        best_tok = tl.where(better, tok, best_tok)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + r, tl.min(tl.where(best == top, best_tok, V), axis=0).to(tl.int64))


def seeded_race(probs: torch.Tensor, row_keys: torch.Tensor, rows: torch.Tensor | None = None,
                noise_out: torch.Tensor | None = None) -> torch.Tensor:
    """probs [B, V] float32 (unit stride along V; not modified), row_keys [R] int64 (rng's
    row keys), rows [R] int64 indices into probs (None: R == B, row r is row r) -> [R] int64
    token ids. noise_out [R, V] float32 (tests): also receives the noise E."""
    assert probs.dtype == torch.float32 and probs.stride(1) == 1
    num = row_keys.shape[0]
    out = torch.empty(num, dtype=torch.int64, device=probs.device)
    if num == 0:
        return out
    _seeded_race_kernel[(num,)](
        probs, probs.stride(0), rows if rows is not None else row_keys, row_keys, out,
        noise_out if noise_out is not None else probs, probs.shape[1],
        HAS_ROWS=rows is not None, STORE_NOISE=noise_out is not None, BLOCK=BLOCK, num_warps=4)
    return out
