"""Sort a step's (token, expert) pairs by expert, each expert's run padded to a whole block.

The fused MoE GEMMs (kernels/fused_moe.py) give each program one BLOCK_M-row block of one
expert, so the pairs are laid out expert by expert, each run rounded up to BLOCK_M rows:

    topk_ids (T=3, k=2):  t0 -> (2, 0)   t1 -> (0, 1)   t2 -> (2, 1)     entries e = t * k + j
    entry:                 0  1           2  3           4  5
    BLOCK_M = 4:
    sorted_ids:    [1 2 S S | 3 5 S S | 0 4 S S]     S = sentinel N (= T * k): a padding row
    block_expert:  [0       | 1       | 2      ]  -1 for the blocks past num_padded
    num_padded:    12 (a device scalar: the grid is sized by the bound below, extra blocks exit)

Within an expert, entries keep their order (a stable sort). Every shape depends on T only, never
on the routing, so the step can be captured in a CUDA graph:
    max_padded = round_up(N + min(N, E) * (BLOCK_M - 1), BLOCK_M)   (at most min(N, E) runs)

Kernels, one-hot counting ([SUB, E_PAD] tiles, no atomics, so the interpreter runs them too):
- N <= SINGLE_MAX: one program does everything (a decode step: one launch a layer).
- else, chunks of CHUNK entries: count per chunk (grid C) -> offsets (one program, a loop over
  the C chunk counts) -> scatter (grid C).
`stats` (optional, int64 [E]) gets each expert's count of entries whose token is valid (the
runner's per-expert token counters; CUDA-graph padding tokens are not valid).
"""

from __future__ import annotations

import torch

from minivllm.kernels.fused_ops import _jit, triton

if triton is not None:
    import triton.language as tl
else:  # CPU-only installs: the reference below is all there is
    tl = None

SUB = 64  # entries per one-hot tile
SINGLE_MAX = 1024  # up to this many entries: the one-program kernel
MAX_CHUNKS = 64  # the offsets program loops over at most about this many chunk counts


def max_padded_rows(num_entries: int, num_experts: int, block_m: int) -> int:
    rows = num_entries + min(num_entries, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch, same layout and sizes as `moe_align`: (sorted_ids int32 [max_padded],
    block_expert int32 [max_padded / block_m], num_padded int32 [1])."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    size = max_padded_rows(n, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[start[flat[order]] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), block_start, right=True).to(torch.int32)
    block_expert[block_start >= padded.sum()] = -1
    return sorted_ids, block_expert, padded.sum().to(torch.int32).reshape(1)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, stats: torch.Tensor | None = None,
              token_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [T, k] int32/int64 expert ids in [0, num_experts) -> (sorted_ids, block_expert,
    num_padded) as in the module docstring. stats: int64 [num_experts] counters to add each
    expert's valid entries to; token_valid: bool [T] (None: every token)."""
    n = topk_ids.numel()
    device = topk_ids.device
    size = max_padded_rows(n, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if n == 0:
        num_padded.zero_()
        return sorted_ids, block_expert, num_padded
    ids = topk_ids.reshape(-1)
    has_stats = stats is not None
    stats_arg = stats if has_stats else num_padded
    valid_arg = token_valid if token_valid is not None else ids
    e_pad = triton.next_power_of_2(num_experts)
    common = dict(E=num_experts, E_PAD=e_pad, BLOCK_M=block_m, SUB=SUB, TOP_K=topk_ids.shape[-1],
                  STATS=has_stats, HAS_VALID=token_valid is not None)
    if n <= SINGLE_MAX:
        _align_single_kernel[(1,)](ids, n, valid_arg, sorted_ids, block_expert, num_padded, stats_arg,
                                   size // block_m, CHUNK=triton.next_power_of_2(max(n, SUB)), **common)
        return sorted_ids, block_expert, num_padded
    chunk = max(SUB * 4, triton.next_power_of_2(-(-n // MAX_CHUNKS)))
    num_chunks = -(-n // chunk)
    chunk_counts = torch.empty(num_chunks, 2, e_pad, dtype=torch.int32, device=device)  # [:, 0] all, [:, 1] valid
    expert_start = torch.empty(e_pad, dtype=torch.int32, device=device)
    _align_count_kernel[(num_chunks,)](ids, n, valid_arg, chunk_counts, CHUNK=chunk, **common)
    _align_offsets_kernel[(1,)](chunk_counts, num_chunks, n, sorted_ids, block_expert, num_padded, expert_start,
                                stats_arg, size // block_m, **common)
    _align_scatter_kernel[(num_chunks,)](ids, n, chunk_counts, expert_start, sorted_ids, CHUNK=chunk, **common)
    return sorted_ids, block_expert, num_padded


# ---------------------------------------------------------------- device helpers


@_jit
def _onehot(ids_ptr, valid_ptr, base, n, E_PAD: tl.constexpr, SUB: tl.constexpr, TOP_K: tl.constexpr,
            HAS_VALID: tl.constexpr):
    """Entries base .. base + SUB: (one-hot [SUB, E_PAD] int32, the same for valid tokens only,
    entry indices [SUB], in-range mask [SUB])."""
    offs = base + tl.arange(0, SUB)
    inside = offs < n
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1).to(tl.int32)
    hot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    if HAS_VALID:
        valid = tl.load(valid_ptr + offs // TOP_K, mask=inside, other=0) != 0
        vhot = hot * valid.to(tl.int32)[:, None]
    else:
        vhot = hot
    return hot, vhot, offs, inside


@_jit
def _count(ids_ptr, valid_ptr, base, n, CHUNK: tl.constexpr, E_PAD: tl.constexpr, SUB: tl.constexpr,
           TOP_K: tl.constexpr, HAS_VALID: tl.constexpr):
    """Per-expert counts [E_PAD] of entries base .. base + CHUNK: (all, valid tokens only)."""
    cnt = tl.zeros([E_PAD], dtype=tl.int32)
    vcnt = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        hot, vhot, _, _ = _onehot(ids_ptr, valid_ptr, base + s, n, E_PAD, SUB, TOP_K, HAS_VALID)
        cnt += tl.sum(hot, axis=0)
        vcnt += tl.sum(vhot, axis=0)
    return cnt, vcnt


@_jit
def _layout(total, vtotal, n, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, stats_ptr, num_blocks,
            E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, STATS: tl.constexpr):
    """From per-expert totals: writes num_padded, block_expert, the sentinel of every padding
    row, and adds the valid counts to stats; returns each expert's first row [E_PAD]."""
    experts = tl.arange(0, E_PAD)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_padded = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, num_padded)
    for b in range(0, num_blocks, 64):
        blocks = b + tl.arange(0, 64)
        pos = blocks * BLOCK_M
        # the expert holding row pos: how many runs end at or before it
        owner = tl.sum(((end[None, :] <= pos[:, None]) & (experts[None, :] < E)).to(tl.int32), axis=1)
        owner = tl.where(pos < num_padded, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)
    pad = tl.arange(0, BLOCK_M)
    pad_rows = start[:, None] + total[:, None] + pad[None, :]
    pad_mask = (pad_rows < end[:, None]) & (experts[:, None] < E)
    tl.store(sorted_ids_ptr + pad_rows, tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32) + n, mask=pad_mask)
    if STATS:
        mask = experts < E
        old = tl.load(stats_ptr + experts, mask=mask, other=0)
        tl.store(stats_ptr + experts, old + vtotal.to(tl.int64), mask=mask)
    return start


@_jit
def _scatter(ids_ptr, valid_ptr, base, n, run_base, sorted_ids_ptr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
             SUB: tl.constexpr, TOP_K: tl.constexpr):
    """Entries base .. base + CHUNK to their rows: run_base [E_PAD] is the first free row of each
    expert's run for this chunk; entries keep their order within an expert."""
    seen = run_base
    for s in range(0, CHUNK, SUB):
        hot, _, offs, inside = _onehot(ids_ptr, valid_ptr, base + s, n, E_PAD, SUB, TOP_K, False)
        before = tl.cumsum(hot, axis=0) - hot  # earlier entries of the same expert in this tile
        row = tl.sum((before + seen[None, :]) * hot, axis=1)
        tl.store(sorted_ids_ptr + row, offs.to(tl.int32), mask=inside)
        seen += tl.sum(hot, axis=0)


# ---------------------------------------------------------------- kernels

if triton is not None:
    @triton.jit
    def _align_single_kernel(ids_ptr, n, valid_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, stats_ptr,
                             num_blocks, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                             SUB: tl.constexpr, TOP_K: tl.constexpr, STATS: tl.constexpr, HAS_VALID: tl.constexpr,
                             CHUNK: tl.constexpr):
        total, vtotal = _count(ids_ptr, valid_ptr, 0, n, CHUNK, E_PAD, SUB, TOP_K, HAS_VALID)
        start = _layout(total, vtotal, n, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, stats_ptr, num_blocks,
                        E, E_PAD, BLOCK_M, STATS)
        _scatter(ids_ptr, valid_ptr, 0, n, start, sorted_ids_ptr, CHUNK, E_PAD, SUB, TOP_K)

    @triton.jit
    def _align_count_kernel(ids_ptr, n, valid_ptr, chunk_counts_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, SUB: tl.constexpr, TOP_K: tl.constexpr, STATS: tl.constexpr,
                            HAS_VALID: tl.constexpr, CHUNK: tl.constexpr):
        c = tl.program_id(0)
        cnt, vcnt = _count(ids_ptr, valid_ptr, c * CHUNK, n, CHUNK, E_PAD, SUB, TOP_K, HAS_VALID)
        experts = tl.arange(0, E_PAD)
        tl.store(chunk_counts_ptr + c * 2 * E_PAD + experts, cnt)
        tl.store(chunk_counts_ptr + c * 2 * E_PAD + E_PAD + experts, vcnt)

    @triton.jit
    def _align_offsets_kernel(chunk_counts_ptr, num_chunks, n, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                              expert_start_ptr, stats_ptr, num_blocks, E: tl.constexpr, E_PAD: tl.constexpr,
                              BLOCK_M: tl.constexpr, SUB: tl.constexpr, TOP_K: tl.constexpr, STATS: tl.constexpr,
                              HAS_VALID: tl.constexpr):
        experts = tl.arange(0, E_PAD)
        total = tl.zeros([E_PAD], dtype=tl.int32)
        vtotal = tl.zeros([E_PAD], dtype=tl.int32)
        for c in range(num_chunks):
            # chunk c's "all" counts become its offset inside each expert's run
            cnt = tl.load(chunk_counts_ptr + c * 2 * E_PAD + experts)
            vtotal += tl.load(chunk_counts_ptr + c * 2 * E_PAD + E_PAD + experts)
            tl.store(chunk_counts_ptr + c * 2 * E_PAD + experts, total)
            total += cnt
        start = _layout(total, vtotal, n, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, stats_ptr, num_blocks,
                        E, E_PAD, BLOCK_M, STATS)
        tl.store(expert_start_ptr + experts, start)

    @triton.jit
    def _align_scatter_kernel(ids_ptr, n, chunk_counts_ptr, expert_start_ptr, sorted_ids_ptr, E: tl.constexpr,
                              E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr, TOP_K: tl.constexpr,
                              STATS: tl.constexpr, HAS_VALID: tl.constexpr, CHUNK: tl.constexpr):
        c = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        run_base = tl.load(expert_start_ptr + experts) + tl.load(chunk_counts_ptr + c * 2 * E_PAD + experts)
        _scatter(ids_ptr, ids_ptr, c * CHUNK, n, run_base, sorted_ids_ptr, CHUNK, E_PAD, SUB, TOP_K)
