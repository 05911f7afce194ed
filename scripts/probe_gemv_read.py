"""Probe (issue 25): how fast can the batch-1 W4A16 GEMV's READS alone go, on its own tiles?

The GEMV (kernels/w4a16_gemm.py) runs Llama-3.1-8B's large weights at 55-67 % of the H200's copy
rate, and neither fewer instructions (XPAIR), another weight layout, L2 prefetch nor longer
programs (stream-K, lease 48) moved it. This times kernels that read exactly what the GEMV reads,
tile for tile, with its grid, its K steps and its next-step-before-this-step loop, but do no
dequantization or products (they XOR the words and add the scales into a value that is stored,
so nothing is optimized away):

    read-gemv   the kept launch's tile and split: [BLOCK_K/8, BLOCK_N] words + the scale and
                zero tiles per step, as the GEMV loads them
    read-sz-*   the same words with the scales and zeros read otherwise (_read_tiles_kernel's SZ
                modes: through L1, a row per group, packed in one int32 tile, the group rows alone)
    read-words  the same without the scale and zero tiles
    read-wide   the words alone with 128-column tiles (512-byte rows)
    stream      one flat read of the words at 16 KB a program-step (the access pattern's best)
    gemv        the engine's GEMV at the kept launch, for scale
    gemv-pairs  the same on interleaved scales and zeros (quant/w4.py: interleave_scale_zero, the
                GPU loader's layout): each pair read as one word (SZ_PAIRS). Lease 51 timed it
                slower than gemv on three of the four weights, yet in the engine the pairs took
                W11-awq from 2.74 to 2.60 ms a token (leases 53-54): rank GEMV changes in the engine

If read-gemv runs near `stream`, the loads are not what holds the GEMV back (its math and the
chain from load to product are); if read-gemv is as slow as the GEMV, its tiles' access is.
Lease 49 (H200): read-words ran at the flat read's rate (gate_up 15.2 us, 3.86 TB/s) and read-gemv
5 us slower (20.2 us), the GEMV 2 us above that: the scale and zero tiles, 6 % of the bytes, cost
a quarter of the time. The read-sz-* modes ask which way of reading them costs least: lease 50,
the packed pairs (a layer's reads 43.8 -> 39.2 us; through L1, 43.3: the GEMV's SZ_L1 switch, since
removed, moved a token by 0.01 ms). The GEMV now reads the pairs (SZ_PAIRS).

    python3 scripts/probe_gemv_read.py [--out probe.json]        (GPU; ~1 minute)
    TRITON_INTERPRET=1 python3 scripts/probe_gemv_read.py --check  (CPU: the kernels' sums are right)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128


# how _read_tiles_kernel reads the scales and zeros (SZ): the words are read as the GEMV reads them
SZ_NONE, SZ_TILES, SZ_TILES_L1, SZ_ROWS, SZ_PACKED, SZ_GROUP_TILE = 0, 1, 2, 3, 4, 5


@triton.jit
def _read_tiles_kernel(qw_ptr, s_ptr, z_ptr, sz_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, GROUP: tl.constexpr, SZ: tl.constexpr):
    """The GEMV's loads (K slice pid_k of column tile pid_n), step t + 1's words issued before
    step t is used; out[pid_k, pid_n * BLOCK_N + j] = XOR of the words and of the scales' and
    zeros' bits, read per SZ:
      SZ_TILES      [BLOCK_K/8, BLOCK_N] tiles through L2 (.cg), a group's row once per word row:
                    the GEMV's reads
      SZ_TILES_L1   the same tiles through L1 (.ca): the word rows of one group hit there
      SZ_ROWS       one [BLOCK_N] row per group, spread over the word rows with selects
      SZ_PACKED     one int32 tile of (scale, zero) pairs (sz_ptr: [K/G, N]) through L2
      SZ_GROUP_TILE one [BLOCK_K/G, BLOCK_N] tile of the step's groups, XOR-ed on its own (the
                    loads alone, no spreading: a lower bound for any row-per-group scheme)"""
    pid_n, pid_k = tl.program_id(0), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_K // 8)
    steps = K // BLOCK_K
    per = tl.cdiv(steps, SPLIT_K)
    t0, t1 = pid_k * per, tl.minimum((pid_k + 1) * per, steps)
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.int32)
    side = tl.zeros([BLOCK_N], dtype=tl.int32)
    w = tl.load(qw_ptr + (t0 * (BLOCK_K // 8) + rw)[:, None] * N + rn[None, :], cache_modifier=".cg")
    for t in range(t0, t1):
        nxt = tl.minimum(t + 1, t1 - 1)
        words = nxt * (BLOCK_K // 8) + rw
        w_n = tl.load(qw_ptr + words[:, None] * N + rn[None, :], cache_modifier=".cg")
        acc ^= w
        g_off = ((t * BLOCK_K + rw * 8) // GROUP)[:, None] * N + rn[None, :]
        if SZ == 1:
            acc += _bits(tl.load(s_ptr + g_off, cache_modifier=".cg")) ^ _bits(tl.load(z_ptr + g_off,
                                                                                      cache_modifier=".cg"))
        if SZ == 2:
            acc += _bits(tl.load(s_ptr + g_off, cache_modifier=".ca")) ^ _bits(tl.load(z_ptr + g_off,
                                                                                      cache_modifier=".ca"))
        if SZ == 3:
            g0 = (t * BLOCK_K) // GROUP
            sv = tl.broadcast_to(_row(s_ptr, g0, N, rn)[None, :], (BLOCK_K // 8, BLOCK_N))
            zv = tl.broadcast_to(_row(z_ptr, g0, N, rn)[None, :], (BLOCK_K // 8, BLOCK_N))
            for j in tl.static_range(1, BLOCK_K // GROUP):
                later = (rw >= j * (GROUP // 8))[:, None]
                sv = tl.where(later, _row(s_ptr, g0 + j, N, rn)[None, :], sv)
                zv = tl.where(later, _row(z_ptr, g0 + j, N, rn)[None, :], zv)
            acc += sv ^ zv
        if SZ == 4:
            acc += tl.load(sz_ptr + g_off, cache_modifier=".cg")
        if SZ == 5:
            gr = ((t * BLOCK_K) // GROUP + tl.arange(0, BLOCK_K // GROUP))[:, None] * N + rn[None, :]
            tile = _bits(tl.load(s_ptr + gr, cache_modifier=".cg")) ^ _bits(tl.load(z_ptr + gr, cache_modifier=".cg"))
            side ^= tl.xor_sum(tile, 0)
        w = w_n
    tl.store(out_ptr + pid_k * N + rn, tl.xor_sum(acc, 0) ^ side)


@triton.jit
def _bits(v):
    return v.to(tl.int16, bitcast=True).to(tl.int32)


@triton.jit
def _row(ptr, g, N, rn):
    """Group g's [BLOCK_N] scales (or zeros) as int32 bits, through L2."""
    return _bits(tl.load(ptr + g * N + rn, cache_modifier=".cg"))


@triton.jit
def _stream_kernel(qw_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Flat read: program p XORs words [p * STEPS * BLOCK, (p + 1) * STEPS * BLOCK)."""
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(STEPS):
        idx = (p * STEPS + i) * BLOCK + offs
        acc ^= tl.load(qw_ptr + idx, mask=idx < n_words, other=0, cache_modifier=".cg")
    tl.store(out_ptr + p, tl.xor_sum(acc, 0))


def read_tiles(qw, s, z, sz, cfg: dict, split: int, mode: int) -> torch.Tensor:
    k, n = qw.shape[0] * 8, qw.shape[1]
    out = torch.empty(split, n, dtype=torch.int32, device=qw.device)
    _read_tiles_kernel[(n // cfg["BLOCK_N"], 1, split)](
        qw, s, z, sz, out, n, k, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, GROUP=GROUP, SZ=mode,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3))
    return out


def packed_sz(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """int32 [K/G, N]: each column's 16-bit scale in the low half, its zero in the high half."""
    return (s.view(torch.int16).to(torch.int32) & 0xFFFF) | (z.view(torch.int16).to(torch.int32) << 16)


def stream(qw, block: int = 4096, steps: int = 4) -> torch.Tensor:
    n_words = qw.numel()
    programs = triton.cdiv(n_words, block * steps)
    out = torch.empty(programs, dtype=torch.int32, device=qw.device)
    _stream_kernel[(programs,)](qw, out, n_words, BLOCK=block, STEPS=steps, num_warps=8)
    return out


def check() -> None:
    """CPU (TRITON_INTERPRET=1): the read kernels' XORs equal torch's on a small weight."""
    g = torch.Generator().manual_seed(0)
    k, n = 512, 64
    qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32)
    s = torch.rand(k // GROUP, n, generator=g).half()
    z = torch.randint(0, 16, (k // GROUP, n), generator=g).half()
    for split in (1, 2):
        got = read_tiles(qw, s, z, packed_sz(s, z), {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4}, split, SZ_NONE)
        want = torch.stack([_xor_rows(part) for part in qw.chunk(split, 0)])
        assert torch.equal(got, want), (split, got, want)
        # every scale mode reads the same values: the same XOR whichever way the rows are spread
        cfg = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}
        modes = [read_tiles(qw, s, z, packed_sz(s, z), cfg, split, mode) for mode in (SZ_TILES, SZ_TILES_L1, SZ_ROWS)]
        assert all(torch.equal(modes[0], m) for m in modes[1:]), (split, modes)
        for mode in (SZ_PACKED, SZ_GROUP_TILE):  # (other values: they only have to run)
            assert read_tiles(qw, s, z, packed_sz(s, z), cfg, split, mode).shape == (split, n)
    flat = stream(qw, block=256, steps=2)
    assert int(_xor_rows(flat.view(-1, 1))[0]) == int(_xor_rows(qw.view(-1, 1))[0])
    print("check: the read kernels' XORs match")


def _xor_rows(t: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(t.shape[1], dtype=torch.int32)
    for row in t:
        acc ^= row
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="CPU check of the kernels under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.check:
        check()
        return
    from minivllm.bench.gpu_timing import copies_for, time_graph
    from minivllm.kernels.w4a16_gemm import gemv_launch, w4a16_gemm
    from minivllm.quant.w4 import interleave_scale_zero
    report = {"device": torch.cuda.get_device_name(0), "shapes": {}}
    for name, (k, n) in SHAPES.items():
        cfg, split = gemv_launch(n, k, GROUP, torch.device("cuda"))
        split = split or 1
        nbytes = k * n // 2 + 2 * 2 * (k // GROUP) * n
        copies = copies_for(nbytes)
        ws = [(torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda"),
               (torch.rand(k // GROUP, n, device="cuda") * 0.01).half(),
               torch.randint(0, 16, (k // GROUP, n), device="cuda").half()) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        wide = dict(cfg, BLOCK_N=128)
        sz = [packed_sz(w[1], w[2]) for w in ws]
        pairs = [interleave_scale_zero(w[1], w[2]) for w in ws]
        runs = {"gemv": lambda i: w4a16_gemm(x, *ws[i], GROUP),
                "gemv-pairs": lambda i: w4a16_gemm(x, ws[i][0], *pairs[i], GROUP)}
        for label, mode in (("read-gemv", SZ_TILES), ("read-sz-l1", SZ_TILES_L1), ("read-sz-rows", SZ_ROWS),
                            ("read-sz-packed", SZ_PACKED), ("read-sz-groups", SZ_GROUP_TILE), ("read-words", SZ_NONE)):
            runs[label] = (lambda i, mode=mode: read_tiles(*ws[i], sz[i], cfg, split, mode))
        runs["read-wide"] = lambda i: read_tiles(*ws[i], sz[i], wide, split, SZ_NONE)
        runs["stream"] = lambda i: stream(ws[i][0])
        row = {"tile": [cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]], "split": split, "bytes": nbytes}
        for label, fn in runs.items():
            read = k * n // 2 if label in ("read-words", "read-wide", "stream") else nbytes  # (those: the words only)
            us = time_graph(fn, copies)
            row[label] = {"us": us, "TBps": read / us / 1e6}
            print(f"{name:8s} {label:11s} {us:7.2f} us {read / us / 1e6:5.2f} TB/s", flush=True)
        report["shapes"][name] = row
        del ws
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    main()
