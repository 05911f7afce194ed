"""Batch-invariant attention sweep (issue 22): batch-invariant mode serves every row, decode rows
included, with the prefill kernel's fixed 16-row tile (kernels/prefill_attention.py,
ALL_MASKED); this times its launch options (BLOCK_N, warps, stages) on W1-like decode batches
(Qwen3-0.6B heads: 16 query heads, 8 KV heads of 128), against the default mode's split decode
kernel on the same rows, and says which give the current launch's bits.

Every launch is batch-invariant by construction (one tile for every row, every key tile masked);
`same_bits` says whether switching to it changes the mode's numbers. Prints the launch with the
least total time over the cases, as "best: BLOCK_N,warps,stages" (MINIVLLM_INVARIANT_ATTN's form).
Then the ROWSUM_MMA check: with the row sums on the tensor cores, do 16-, 32- and 64-row tiles
give the same bits (then the mode could use 64-row tiles for prompt chunks), and how fast are they
on a prompt chunk against the mode's launch today and the default mode's.

    python3 scripts/bench_invariant_attention.py --out inv-attn.json    # ~1 minute on an H100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minivllm.attention.triton_backend import INVARIANT_BLOCK_M, invariant_max_query_len  # noqa: E402
from minivllm.bench.kernel_bench import build_paged, timer  # noqa: E402
from minivllm.kernels import decode_attention as da  # noqa: E402
from minivllm.kernels.prefill_attention import prefill_attention, prefill_config  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
CASES = [(256, 300), (256, 900), (128, 1400), (32, 1600)]  # (decode rows, mean context): W1's phases
LAUNCHES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 2, 2), (64, 2, 3), (64, 8, 2), (128, 4, 2), (128, 4, 3),
            (128, 8, 2), (128, 8, 3), (32, 4, 3), (32, 4, 4), (32, 2, 3), (32, 2, 4)]


def current_launch() -> tuple[int, int, int]:
    """The engine's launch today (prefill_config's at the invariant tile, with any env override)."""
    cfg = prefill_config(HEADS // KV_HEADS, HEAD_DIM, invariant_max_query_len(HEADS // KV_HEADS), invariant=True)
    assert cfg["BLOCK_M"] == INVARIANT_BLOCK_M
    return cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]


def run_case(rows: int, ctx: int, bench) -> dict:
    rng = random.Random(rows * 7 + ctx)
    lens = [rng.randint(ctx // 2, ctx * 3 // 2) for _ in range(rows)]
    paged = build_paged(lens, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda", seed=rows)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    mql = invariant_max_query_len(HEADS // KV_HEADS)

    def inv(launch):
        bn, warps, stages = launch
        return prefill_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables, scale,
                                 max_query_len=mql, invariant=True,
                                 config={"BLOCK_N": bn, "num_warps": warps, "num_stages": stages})

    kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2
    base = inv(current_launch())
    ref = da.decode_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables, scale,
                              max_seq_len=max(lens))
    decode_ms = bench(lambda: da.decode_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables,
                                                  scale, max_seq_len=max(lens)))
    out = {"rows": rows, "ctx": ctx, "kv_MB": kv_bytes / 1e6, "decode_split_ms": decode_ms,
           "decode_split_TBps": kv_bytes / decode_ms / 1e9, "launches": []}
    for launch in dict.fromkeys([current_launch()] + LAUNCHES):  # (the launch today first, once)
        try:
            got = inv(launch)
            ms = bench(lambda launch=launch: inv(launch))
        except Exception as e:  # noqa: BLE001 - a launch the compiler refuses (shared memory): skip it
            print(f"rows {rows} ctx {ctx} {launch}: failed ({type(e).__name__})", flush=True)
            continue
        err = float((got.float() - ref.float()).abs().max())
        out["launches"].append({"launch": list(launch), "ms": ms, "TBps": kv_bytes / ms / 1e9,
                                "same_bits": bool(torch.equal(got, base)), "max_abs_vs_decode": err})
    cur = next(r for r in out["launches"] if tuple(r["launch"]) == current_launch())
    best = min(out["launches"], key=lambda r: r["ms"])
    print(f"rows {rows:4d} ctx ~{ctx:5d} ({out['kv_MB']:7.1f} MB): decode split {decode_ms * 1e3:7.1f} us "
          f"({out['decode_split_TBps']:.2f} TB/s), invariant now {cur['ms'] * 1e3:7.1f} us ({cur['TBps']:.2f} TB/s), "
          f"best {best['ms'] * 1e3:7.1f} us {best['launch']} (same bits: {best['same_bits']})", flush=True)
    del paged
    torch.cuda.empty_cache()
    return out


# softmax_accumulate's ROWSUM_MMA (the row sums on the tensor cores): with it a row's bits should
# depend on BLOCK_N alone, so the mode could take prefill_config's BLOCK_M (64 for prompt chunks)
# instead of 16 everywhere. Launches (BLOCK_M, warps) at the mode's BLOCK_N and stages.
ROWSUM_LAUNCHES = [(16, 4), (32, 4), (64, 4), (64, 8)]
MIXED = ([(512, 512)] * 8, [(1, 900)] * 32)  # (query tokens, context) of fresh prompts, of decode rows


def rowsum_case(name: str, specs: list[tuple[int, int]], bench) -> dict:
    """ROWSUM_MMA at every launch of ROWSUM_LAUNCHES against its 16-row launch (same bits?), and
    the mode's launch today (tl.sum, 16 rows) and the default mode's prefill launch for the time."""
    lens = [ctx for _, ctx in specs]
    q_lens = [q for q, _ in specs]
    paged = build_paged(lens, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda", seed=len(specs))
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0] + list(__import__("itertools").accumulate(q_lens)), dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    bn, _, stages = current_launch()

    def run(config, invariant=True, mql=None):
        return prefill_attention(q, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables, scale,
                                 max_query_len=mql or invariant_max_query_len(HEADS // KV_HEADS), invariant=invariant,
                                 config=config)

    out = {"case": name, "mode_now_ms": bench(lambda: run(None)),
           "default_mode_ms": bench(lambda: run(None, invariant=False, mql=max(q_lens))), "launches": []}
    base = run({"BLOCK_M": 16, "num_warps": 4, "ROWSUM_MMA": True})
    for bm, warps in ROWSUM_LAUNCHES:
        cfg = {"BLOCK_M": bm, "num_warps": warps, "BLOCK_N": bn, "num_stages": stages, "ROWSUM_MMA": True}
        try:
            got = run(cfg)
            ms = bench(lambda cfg=cfg: run(cfg))
        except Exception as e:  # noqa: BLE001 - a launch the compiler refuses: skip it
            print(f"{name} rowsum {bm} rows {warps} warps: failed ({type(e).__name__})", flush=True)
            continue
        out["launches"].append({"BLOCK_M": bm, "num_warps": warps, "ms": ms, "same_bits": bool(torch.equal(got, base))})
    print(f"{name}: mode now {out['mode_now_ms'] * 1e3:.1f} us, default mode {out['default_mode_ms'] * 1e3:.1f} us; "
          "ROWSUM_MMA: " + ", ".join(f"{r['BLOCK_M']} rows {r['num_warps']} warps {r['ms'] * 1e3:.1f} us "
                                      f"(same bits: {r['same_bits']})" for r in out["launches"]), flush=True)
    del paged
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    args = ap.parse_args()
    bench = timer(False)
    cases = [run_case(rows, ctx, bench) for rows, ctx in CASES]
    totals = {}
    for case in cases:
        for r in case["launches"]:
            totals.setdefault(tuple(r["launch"]), []).append(r["ms"])
    totals = {k: sum(v) for k, v in totals.items() if len(v) == len(cases)}
    for launch, ms in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"launch {launch}: {ms * 1e3:8.1f} us over the cases", flush=True)
    best = min(totals, key=totals.get)
    print(f"current: {','.join(map(str, current_launch()))} ({totals[current_launch()] * 1e3:.1f} us); "
          f"best: {','.join(map(str, best))} ({totals[best] * 1e3:.1f} us)", flush=True)
    rowsum = [rowsum_case("prompts+decode", MIXED[0] + MIXED[1], bench), rowsum_case("prompts", MIXED[0], bench),
              rowsum_case("decode 256x900", [(1, 900)] * 256, bench)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "cases": cases, "rowsum_mma": rowsum,
                       "totals_us": {",".join(map(str, k)): v * 1e3 for k, v in totals.items()},
                       "current": list(current_launch()), "best": list(best)}, f, indent=1)


if __name__ == "__main__":
    main()
