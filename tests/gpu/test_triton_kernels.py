"""The Triton attention kernels against the plain-PyTorch reference, on random paged batches.

The case builders and `check_*` helpers here are device-agnostic: tests/unit/test_triton_interpret.py
runs them on the CPU under TRITON_INTERPRET=1 with small shapes; the tests in this file run
them on a CUDA GPU with realistic ones.

Every check poisons what the kernel must not depend on: cache slots that hold no token are
NaN (a kernel reading past a sequence's end, or through a padded block-table entry, without
masking the load turns its output NaN), and outputs start as NaN (an unwritten element shows).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import paged_attention_reference, store_kv_reference

TOL = 1e-2  # relative error ||out - ref|| / ||ref|| (bf16 / fp16)


# ---------------------------------------------------------------- case building (any device)


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens (+ padding), num_heads, head_dim]
    key: torch.Tensor  # [total context tokens, num_kv_heads, head_dim]: every token of every sequence
    value: torch.Tensor
    slots: torch.Tensor  # [total context tokens] int64 cache slot of each row of key/value
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], filled
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    qsl_list: list[int]
    seq_lens_list: list[int]
    scale: float

    @property
    def num_valid(self) -> int:
        return self.qsl_list[-1]

    def metadata(self) -> AttentionMetadata:
        q_lens = [b - a for a, b in zip(self.qsl_list, self.qsl_list[1:])]
        new_slots = _new_token_slots(self.slots, self.seq_lens_list, q_lens)
        return AttentionMetadata(
            slot_mapping=new_slots, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, max_query_len=max(q_lens), max_seq_len=max(self.seq_lens_list),
            query_start_loc_cpu=self.qsl_list, seq_lens_cpu=self.seq_lens_list,
        )


def _new_token_slots(slots: torch.Tensor, seq_lens: list[int], q_lens: list[int]) -> torch.Tensor:
    parts, offset = [], 0
    for seq_len, q_len in zip(seq_lens, q_lens):
        parts.append(slots[offset + seq_len - q_len : offset + seq_len])
        offset += seq_len
    return torch.cat(parts)


def make_case(
    specs: list[tuple[int, int]],  # (q_len, seq_len) per sequence, q_len <= seq_len
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    pad_tokens: int = 0,  # extra query rows past the last sequence (CUDA-graph style padding)
) -> PagedCase:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # scattered, non-monotonic block ids
    max_blocks = max(blocks_per_seq) + 2  # padded table columns (0 = a block owned by someone)
    table = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    slots, pos = [], 0
    for i, (n, (_, seq_len)) in enumerate(zip(blocks_per_seq, specs)):
        ids = perm[pos : pos + n]
        pos += n
        table[i, :n] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[t // block_size] * block_size + t % block_size for t in range(seq_len)]
    total = len(slots)
    q_lens = [q for q, _ in specs]
    num_tokens = sum(q_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    case = PagedCase(
        query=rand(num_tokens + pad_tokens, num_heads, head_dim),
        key=rand(total, num_kv_heads, head_dim),
        value=rand(total, num_kv_heads, head_dim),
        slots=torch.tensor(slots, dtype=torch.int64, device=device),
        k_cache=torch.full(shape, float("nan"), dtype=dtype, device=device),  # unwritten slots: NaN
        v_cache=torch.full(shape, float("nan"), dtype=dtype, device=device),
        query_start_loc=torch.tensor([0] + _cumsum(q_lens), dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in specs], dtype=torch.int32, device=device),
        block_tables=table.to(device),
        qsl_list=[0] + _cumsum(q_lens),
        seq_lens_list=[s for _, s in specs],
        scale=head_dim**-0.5,
    )
    store_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slots)
    return case


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def random_specs(rng: random.Random, num_seqs: int, max_ctx: int, kind: str) -> list[tuple[int, int]]:
    """kind: 'fresh' (q_len == seq_len), 'prefix' (cached prefix + chunk), 'decode', 'mixed'."""
    specs = []
    for i in range(num_seqs):
        seq_len = rng.randint(1, max_ctx)
        k = kind if kind != "mixed" else ("decode", "fresh", "prefix")[i % 3]
        if k == "fresh":
            q_len = seq_len
        elif k == "decode":
            q_len = 1
        else:
            q_len = rng.randint(1, seq_len)
        specs.append((q_len, seq_len))
    return specs


Errors = tuple[float, float]  # (relative error of the whole output, worst relative error of one (token, head) row)


def errors(out: torch.Tensor, ref: torch.Tensor) -> Errors:
    """||out - ref|| / ||ref|| overall and per row; inf if out has NaN (an unwritten element).

    The per-row error (always >= the overall one) catches a bug confined to a few rows, e.g.
    one query token seeing one key too many, which the overall norm averages away.
    """
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("inf"), float("inf")
    diff, ref = (out - ref).flatten(0, -2), ref.flatten(0, -2)
    overall = (diff.norm() / ref.norm().clamp_min(1e-6)).item()
    worst = (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()
    return overall, worst


def tolerance(dtype: torch.dtype) -> Errors:
    """fp32: tf32 tensor cores on the GPU, exact math under the interpreter."""
    return (2e-3, 5e-3) if dtype == torch.float32 else (TOL, 4 * TOL)


def ok(errs: Errors, dtype: torch.dtype) -> bool:
    return all(e < t for e, t in zip(errs, tolerance(dtype)))


def reference(case: PagedCase) -> torch.Tensor:
    q = case.query[: case.num_valid]
    return paged_attention_reference(
        q, case.k_cache, case.v_cache, case.qsl_list, case.seq_lens_list, case.block_tables, case.scale)


# ---------------------------------------------------------------- checks (any device)


def check_store_kv(case: PagedCase) -> Errors:
    """Store every token (plus -1 padding slots) with the kernel into fresh caches; compare."""
    from minivllm.kernels.store_kv import store_kv

    pad = torch.full((3,), -1, dtype=torch.int64, device=case.slots.device)
    slots = torch.cat([case.slots, pad])
    key = torch.cat([case.key, torch.full_like(case.key[:3], 1e4)])  # padding rows must not land
    value = torch.cat([case.value, torch.full_like(case.value[:3], 1e4)])
    k_cache = torch.full_like(case.k_cache, float("nan"))
    v_cache = torch.full_like(case.v_cache, float("nan"))
    store_kv(key, value, k_cache, v_cache, slots)
    same_nan = torch.equal(torch.isnan(k_cache), torch.isnan(case.k_cache)) and torch.equal(
        torch.isnan(v_cache), torch.isnan(case.v_cache))
    exact = torch.equal(k_cache.nan_to_num(), case.k_cache.nan_to_num()) and torch.equal(
        v_cache.nan_to_num(), case.v_cache.nan_to_num())
    return (0.0, 0.0) if same_nan and exact else (float("inf"), float("inf"))


def check_prefill(case: PagedCase, invariant: bool = False, config: dict | None = None) -> Errors:
    """invariant: the batch-invariant mode's launch (every key tile through the masked path);
    config: launch options over the kernel's own (e.g. ROWSUM_MMA)."""
    from minivllm.kernels.prefill_attention import prefill_attention

    out = torch.full_like(case.query, float("nan"))
    q_lens = [b - a for a, b in zip(case.qsl_list, case.qsl_list[1:])]
    prefill_attention(case.query, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                      case.block_tables, case.scale, max_query_len=max(q_lens), out=out, invariant=invariant,
                      config=config)
    if case.query.shape[0] > case.num_valid and not torch.isnan(out[case.num_valid :]).all():
        return float("inf"), float("inf")  # padding rows must be left alone
    return errors(out[: case.num_valid], reference(case))


def check_decode(case: PagedCase, num_splits: int | None = None, workspace_splits: int | None = None) -> Errors:
    """num_splits None: automatic choice; workspace_splits: preallocate scratch with that many."""
    from minivllm.kernels.decode_attention import DecodeWorkspace, decode_attention

    ws = None
    if workspace_splits is not None:
        num_heads, head_dim = case.query.shape[1:]
        ws = DecodeWorkspace.allocate(case.seq_lens.shape[0] + 2, num_heads, head_dim, workspace_splits,
                                      case.query.device)
        ws.part_out.fill_(float("nan"))  # stale scratch must not leak into the result
        ws.part_lse.fill_(float("nan"))
    out = torch.full_like(case.query, float("nan"))
    decode_attention(case.query, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                     case.block_tables, case.scale, max_seq_len=max(case.seq_lens_list),
                     num_splits=num_splits, workspace=ws, out=out)
    return errors(out[: case.num_valid], reference(case))


def check_decode_merge_modes(case: PagedCase, num_splits: int, graph: bool = False) -> dict:
    """The chunks merged by the last stage-1 program of each sequence and kv head (the default)
    against the separate merge kernel (MINIVLLM_DECODE_MERGE=kernel): each one's errors against
    the reference, the two outputs' difference (only the merge's summation order differs), and
    whether the counters are all 0 afterwards. graph: the in-kernel merge is captured in a CUDA
    graph and replayed twice; its result is the last replay's."""
    import os

    from minivllm.kernels.decode_attention import decode_attention
    from minivllm.kernels.split_k import COUNTERS

    def attend(out: torch.Tensor) -> None:
        decode_attention(case.query, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                         case.block_tables, case.scale, max_seq_len=max(case.seq_lens_list),
                         num_splits=num_splits, out=out)

    def run(mode: str) -> torch.Tensor:
        old = os.environ.get("MINIVLLM_DECODE_MERGE")
        os.environ["MINIVLLM_DECODE_MERGE"] = mode
        try:
            out = torch.full_like(case.query, float("nan"))
            attend(out)
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    attend(out)
                for _ in range(2):
                    out.fill_(float("nan"))
                    g.replay()
                torch.cuda.synchronize()
            return out[: case.num_valid]
        finally:
            if old is None:
                os.environ.pop("MINIVLLM_DECODE_MERGE", None)
            else:
                os.environ["MINIVLLM_DECODE_MERGE"] = old

    in_split, kernel = run("split"), run("kernel")
    ref = reference(case)
    counters = COUNTERS.get(case.query.device, [])  # (the buffers split_k.tile_counters keeps for this device)
    return {"in_split": errors(in_split, ref), "kernel": errors(kernel, ref), "apart": errors(in_split, kernel)[0],
            "counters_zero": bool(counters) and all(bool((c == 0).all()) for c in counters)}


def _single_token_rows(case: PagedCase) -> torch.Tensor:
    """[num_valid] bool: rows whose sequence has exactly one new token (the decode rows)."""
    rows = torch.zeros(case.num_valid, dtype=torch.bool)
    for a, b in zip(case.qsl_list, case.qsl_list[1:]):
        rows[a:b] = b - a == 1
    return rows.to(case.query.device)


def check_split_roles(case: PagedCase, num_splits: int) -> Errors:
    """A mixed step's two launches: the decode kernel writes exactly the one-token rows, the
    prefill kernel with skip_single_token exactly the others; each matches the reference."""
    from minivllm.kernels.decode_attention import decode_attention
    from minivllm.kernels.prefill_attention import prefill_attention

    single = _single_token_rows(case)
    q_lens = [b - a for a, b in zip(case.qsl_list, case.qsl_list[1:])]
    dec = torch.full_like(case.query, float("nan"))
    decode_attention(case.query, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                     case.block_tables, case.scale, max_seq_len=max(case.seq_lens_list), num_splits=num_splits,
                     out=dec)
    pre = torch.full_like(case.query, float("nan"))
    prefill_attention(case.query, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                      case.block_tables, case.scale, max_query_len=max(q_lens), out=pre, skip_single_token=True)
    dec, pre = dec[: case.num_valid], pre[: case.num_valid]
    untouched = torch.isnan(dec[~single]).all() and torch.isnan(pre[single]).all()
    if not untouched or not single.any() or single.all():
        return float("inf"), float("inf")  # a kernel wrote the other's rows (or the case is degenerate)
    return errors(torch.where(single[:, None, None], dec, pre), reference(case))


def check_backend(case: PagedCase) -> Errors:
    """The registered 'triton' backend: store the new tokens' K/V, then attend."""
    from minivllm.attention.backend import get_attention_backend

    backend = get_attention_backend("triton")
    meta = case.metadata()
    # caches hold only the cached prefixes; the backend stores the new tokens itself
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    k_flat[meta.slot_mapping] = float("nan")
    v_flat[meta.slot_mapping] = float("nan")
    new_k = case.k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping]
    new_v = case.v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping]
    backend.store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = backend.attend(case.query[: case.num_valid], k_cache, v_cache, meta, case.scale)
    return errors(out, reference(case))


# ---------------------------------------------------------------- GPU tests

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128]
GQA = [1, 2, 4, 8]  # query heads per kv head
# every (gqa, head_dim) pair with both dtypes and both cache block sizes, crossed so that the
# number of compiled kernel variants (and the run time) stays modest
COMBOS = [
    pytest.param(dtype, head_dim, group, block_size, id=f"{str(dtype)[6:]}-d{head_dim}-gqa{group}-bs{block_size}")
    for group in GQA
    for head_dim in HEAD_DIMS
    for dtype, block_size in ((torch.bfloat16, 16), (torch.float16, 32))
]


def _heads(group: int) -> tuple[int, int]:
    num_kv_heads = 2 if group == 8 else 4
    return num_kv_heads * group, num_kv_heads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(dtype: torch.dtype, block_size: int) -> None:
    specs = random_specs(random.Random(1), 16, 700, "fresh")
    case = make_case(specs, 8, 8, 128, block_size, dtype, "cuda", seed=1)
    assert check_store_kv(case) == (0.0, 0.0)


@pytest.mark.parametrize("kind,num_seqs,max_ctx", [
    ("fresh", 8, 1200), ("prefix", 16, 3000), ("mixed", 64, 2000), ("decode", 5, 600)])
@pytest.mark.parametrize("dtype,head_dim,group,block_size", COMBOS)
def test_prefill(kind: str, num_seqs: int, max_ctx: int, dtype, head_dim: int, group: int, block_size: int) -> None:
    seed = len(kind) * 1000 + head_dim + group * 10 + block_size
    specs = random_specs(random.Random(seed), num_seqs, max_ctx, kind)
    num_heads, num_kv_heads = _heads(group)
    case = make_case(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=seed, pad_tokens=5)
    errs = check_prefill(case)
    assert ok(errs, dtype), errs


@pytest.mark.parametrize("num_seqs,max_ctx", [(1, 4000), (7, 3000), (64, 2000)])
@pytest.mark.parametrize("dtype,head_dim,group,block_size", COMBOS)
def test_decode(num_seqs: int, max_ctx: int, dtype, head_dim: int, group: int, block_size: int) -> None:
    seed = num_seqs * 7 + head_dim + group + block_size
    specs = random_specs(random.Random(seed), num_seqs, max_ctx, "decode")
    num_heads, num_kv_heads = _heads(group)
    case = make_case(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=seed)
    errs = check_decode(case)
    assert ok(errs, dtype), errs


@pytest.mark.parametrize("num_splits,workspace_splits", [(1, None), (3, None), (16, 16), (5, 64), (64, None)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_fixed_splits(num_splits: int, workspace_splits: int | None, dtype) -> None:
    specs = random_specs(random.Random(3), 24, 5000, "decode") + [(1, 1), (1, 8192)]
    case = make_case(specs, 32, 8, 128, 16, dtype, "cuda", seed=3)
    errs = check_decode(case, num_splits=num_splits, workspace_splits=workspace_splits)
    assert ok(errs, dtype), errs



@pytest.mark.parametrize("num_splits", [2, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_merge_in_split_kernel(num_splits: int, dtype) -> None:
    """Stage 2 done by each (sequence, kv head)'s last stage-1 program: within tolerance of the
    reference like the merge kernel, close to it, its counters back at 0, and the same in CUDA
    graph replays (the counters reset themselves; no memset in the graph)."""
    specs = random_specs(random.Random(8), 12, 5000, "decode") + [(1, 1), (1, 129), (1, 8192)]
    case = make_case(specs, 32, 8, 128, 16, dtype, "cuda", seed=8)
    for graph in (False, True):
        res = check_decode_merge_modes(case, num_splits, graph)
        assert ok(res["in_split"], dtype) and ok(res["kernel"], dtype), res
        assert res["apart"] < (1e-5 if dtype == torch.float32 else 1e-2) and res["counters_zero"], res


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype,head_dim,group,block_size", COMBOS[::3])
def test_mixed_step_split_roles(num_splits: int, dtype, head_dim: int, group: int, block_size: int) -> None:
    specs = random_specs(random.Random(6 + group), 30, 2000, "mixed")
    num_heads, num_kv_heads = _heads(group)
    case = make_case(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=6, pad_tokens=4)
    errs = check_split_roles(case, num_splits)
    assert ok(errs, dtype), errs


@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend(kind: str, dtype) -> None:
    specs = random_specs(random.Random(4), 20, 1500, kind)
    case = make_case(specs, 16, 8, 128, 16, dtype, "cuda", seed=4)
    errs = check_backend(case)
    assert ok(errs, dtype), errs


def test_backend_reserved_workspace() -> None:
    from minivllm.attention.backend import get_attention_backend

    specs = random_specs(random.Random(5), 12, 3000, "decode")
    case = make_case(specs, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=5)
    backend = get_attention_backend("triton")
    backend.reserve_decode_workspace(max_num_seqs=64, num_heads=16, num_kv_heads=8, head_dim=128,
                                     max_seq_len=8192, device="cuda")
    out = backend.attend(case.query, case.k_cache, case.v_cache, case.metadata(), case.scale)
    errs = errors(out, reference(case))
    assert ok(errs, torch.bfloat16), errs


def check_invariant_rows(total: int, num_kv_heads: int, group: int, head_dim: int, dtype, device: str,
                         seed: int = 7) -> list[str]:
    """Batch-invariant mode with the backend's tile (triton_backend.invariant_max_query_len): a
    prompt's rows attended in one step equal, bit for bit, the same rows attended in chunks of
    16 and 64 (later chunks' keys already cached: chunked prefill, a prefix hit) and one token
    at a time as decode rows, alone and beside another sequence's decode row. Returns failures.

    GPU only: under Triton's interpreter tl.dot is numpy's matmul, whose bits for a row depend
    on the tile's other rows (checked on the CPU on 2026-11-27: even the 64-row tile's chunks
    of 16 differ there in the last bits), while a GPU's MMA computes each row alone."""
    from minivllm.attention.triton_backend import invariant_max_query_len
    from minivllm.kernels.prefill_attention import prefill_attention

    mql = invariant_max_query_len(group)
    case = make_case([(total, total), (1, 40)], num_kv_heads * group, num_kv_heads, head_dim, 16, dtype, device,
                     seed=seed)
    dev = case.query.device

    def attend(q, starts, lens, tables):
        qsl = torch.tensor(starts, dtype=torch.int32, device=dev)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        return prefill_attention(q.contiguous(), case.k_cache, case.v_cache, qsl, sl, tables, case.scale,
                                 max_query_len=mql, invariant=True)
    whole = attend(case.query[:total], [0, total], [total], case.block_tables[:1])
    fails = []
    for chunk in (16, 64):
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            part = attend(case.query[start:end], [0, end - start], [end], case.block_tables[:1])
            if not torch.equal(part, whole[start:end]):
                fails.append(f"chunk {chunk} at {start}: max diff {(part - whole[start:end]).abs().max().item()}")
    other = case.query[total:total + 1]  # the second sequence's one decode row
    for i in range(0, total, max(1, total // 12)):
        alone = attend(case.query[i:i + 1], [0, 1], [i + 1], case.block_tables[:1])
        pair = attend(torch.cat([other, case.query[i:i + 1]]), [0, 1, 2], [40, i + 1], case.block_tables.flip(0))
        if not torch.equal(alone[0], whole[i]) or not torch.equal(pair[1], whole[i]):
            fails.append(f"decode row {i} differs from its prompt row")
    return fails


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (3, 64), (4, 128)])
def test_invariant_rows_equal_in_one_step_chunks_and_decode(dtype, group: int, head_dim: int) -> None:
    assert not check_invariant_rows(301, 2, group, head_dim, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_invariant_prefill_rows_do_not_depend_on_the_chunking(dtype, group: int) -> None:
    """Batch-invariant mode: a prompt's rows attended in one step and in chunks of 64 (the later
    chunks' keys already cached: chunked prefill, a prefix hit) are bitwise equal. Without the
    mode the unmasked key range ends at a tile-dependent place, which changed the last bit of a
    row on an H100 (scripts/diagnose_invariance.py)."""
    from minivllm.kernels.prefill_attention import prefill_attention

    total, chunk = 301, 64
    num_heads, num_kv_heads = (3 * group, 3)
    case = make_case([(total, total)], num_heads, num_kv_heads, 64, 16, dtype, "cuda", seed=7)
    whole = prefill_attention(case.query, case.k_cache, case.v_cache, case.query_start_loc, case.seq_lens,
                              case.block_tables, case.scale, max_query_len=64, invariant=True)
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        qsl = torch.tensor([0, end - start], dtype=torch.int32, device="cuda")
        lens = torch.tensor([end], dtype=torch.int32, device="cuda")
        part = prefill_attention(case.query[start:end].contiguous(), case.k_cache, case.v_cache, qsl, lens,
                                 case.block_tables, case.scale, max_query_len=64, invariant=True)
        assert torch.equal(part, whole[start:end]), (start, (part - whole[start:end]).abs().max())
