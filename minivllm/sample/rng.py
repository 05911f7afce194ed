"""Randomness for the sampler: the exponential race, seeded or from a torch.Generator.

Sampling token i with probability p_i is done as ``argmax_i(p_i / E_i)`` with
``E_i ~ Exp(1)`` i.i.d.: the race is exact (the winner of independent exponential clocks
with rates p_i is i with probability p_i), needs no cumulative sum and no sync.

Seeded rows must give the same token for the same (seed, step) whatever batch they run in
and on whatever device, so their E is not drawn from a stateful generator but computed from
a counter-based hash of (seed, counter, token index) with plain int64 torch ops:

    row key   k = mix(mix(seed) ^ counter)            # [R], counter = tokens generated so far
    element   h = mix(k + (token + 1) * GAMMA)        # [R, V]  (SplitMix64 stream)
    uniform   u = (top 52 bits of h + 0.5) / 2**52    # in (0, 1), never 0 or 1, exact in fp64
    E         = float32(-log(u))                      # log in fp64, then rounded: > 0

int64 multiply wraps (two's complement) identically on CPU and CUDA; ``>>`` is arithmetic on
negative int64, so every shift is followed by a mask to emulate the logical shift. The
uniforms are bit-identical on every device; the fp64 log may differ in its last bit between
libm and CUDA, which the rounding to fp32 hides (0 mismatches in 39M values on an H100).
"""

from __future__ import annotations

import os

import torch

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """A 64-bit pattern as the signed int64 torch expects (e.g. 0xbf58... > 2**63)."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _i64(0x9E3779B97F4A7C15)  # SplitMix64 increment (golden ratio)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_UNIFORM_BITS = 52  # (k + 0.5) with k < 2**52 is exact in fp64's 53-bit significand
_CHUNK_ELEMENTS = 1 << 24  # rows are hashed in chunks: int64 temporaries stay ~128 MiB each


def wrap_seed(seed: int) -> int:
    """Any Python int seed -> the int64 with the same low 64 bits."""
    return _i64(seed)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor (``>>`` alone sign-extends)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer, in place on an int64 tensor (a bijection on 64-bit words)."""
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The per-row key k = mix(mix(seed) ^ counter) of seeded_exponentials: [R] int64."""
    return _mix_(_mix_(seeds.clone()) ^ counters)


def seeded_exponentials(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise that depends only on (seed, counter, token index).

    seeds, counters: [R] int64 on the target device. Returns E: [R, vocab_size] float32.
    """
    row_key = row_keys(seeds, counters)  # [R]
    steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device).mul_(_GAMMA)
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))
    for start in range(0, seeds.shape[0], chunk):
        h = row_key[start:start + chunk].unsqueeze(1) + steps  # [r, V], wraps mod 2**64
        _mix_(h)
        u = _shr(h, 64 - _UNIFORM_BITS).to(torch.float64).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)
        out[start:start + chunk] = u.log_().neg_()  # (0, 1) -> E > 0, rounded to fp32
    return out


_UNIFORM_STREAM = _i64(0x5EEDAC0FFEE5EED1)  # keeps seeded_uniforms independent of the race's noise


def seeded_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per (seed, counter), float64, from a stream of its own (the
    acceptance test of speculative decoding; the race at the same counter draws the token).

    seeds, counters: [R] int64 -> [R] float64."""
    key = _mix_(_mix_(seeds ^ _UNIFORM_STREAM) ^ counters)
    _mix_(key)
    return _shr(key, 64 - _UNIFORM_BITS).to(torch.float64).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)


def exponential_race(
    probs: torch.Tensor,  # [B, V] float32, rows sum to 1, masked tokens exactly 0
    generator: torch.Generator | None,
    seeded_rows: torch.Tensor | None,  # [R] int64 row indices, None = every row is seeded
    seeds: torch.Tensor | None,  # [R] int64
    counters: torch.Tensor | None,  # [R] int64
) -> torch.Tensor:  # [B] int64
    """Sample one token per row by the exponential race. ``probs`` is overwritten."""
    num_rows, vocab = probs.shape
    if seeds is not None and _race_kernel_on(probs):
        return _exponential_race_gpu(probs, generator, seeded_rows, row_keys(seeds, counters))
    if seeds is None:  # no seeded row: one fast draw for the whole batch
        noise = _generator_exponentials(probs, generator)
    elif seeded_rows is None:  # every row seeded: no generator draw at all
        noise = seeded_exponentials(seeds, counters, vocab)
    else:
        noise = _generator_exponentials(probs, generator)
        noise.index_copy_(0, seeded_rows, seeded_exponentials(seeds, counters, vocab))
    # the noise is > 0 (see _generator_exponentials; the seeded noise by construction), so a
    # masked token (p = 0) scores 0 and never NaN
    return probs.div_(noise).argmax(dim=-1)


def _generator_exponentials(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise shaped like probs, from the generator. On CUDA torch's exponential_ (never 0
    since torch 2.1). On the CPU exponential_ draws one value at a time (~27 ns each: 43 ms for
    32 rows of a 49k vocab on a 2-core Xeon), so the noise is -log(U) of a vectorised uniform
    draw instead (7.7 ms): U in [0, 1) makes it > 0, and U = 0 (probability 2**-24 per element)
    gives +inf, a score of 0 for that token."""
    if probs.device.type != "cpu":
        return torch.empty_like(probs).exponential_(generator=generator)
    return torch.rand(probs.shape, generator=generator, dtype=probs.dtype).log_().neg_()


def _race_kernel_on(probs: torch.Tensor) -> bool:
    """Seeded rows on a CUDA device go through kernels/seeded_race.py (the same bits, one pass);
    MINIVLLM_SEEDED_RACE_KERNEL=0 keeps the torch form, to compare."""
    if not probs.is_cuda or probs.dtype != torch.float32 or probs.stride(1) != 1:
        return False
    return os.environ.get("MINIVLLM_SEEDED_RACE_KERNEL", "1") != "0"


def _exponential_race_gpu(probs, generator, seeded_rows, keys) -> torch.Tensor:
    """exponential_race with the seeded rows in one Triton pass (before the unseeded rows' race
    overwrites probs); the generator draws for every row, as the torch form does."""
    from minivllm.kernels.seeded_race import seeded_race
    seeded = seeded_race(probs, keys, seeded_rows)
    if seeded_rows is None:
        return seeded
    tokens = probs.div_(_generator_exponentials(probs, generator)).argmax(dim=-1)
    return tokens.index_copy_(0, seeded_rows, seeded)
