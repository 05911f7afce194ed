"""The CPU attention backend (batched decode, per-sequence prefill, index_copy_ stores) against
the plain-PyTorch reference, on random paged layouts."""

from __future__ import annotations

import random

import pytest
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import paged_attention_reference, store_kv_reference
from minivllm.attention.torch_backend import TorchAttentionBackend


def _random_layout(rng: random.Random, bs: int, consecutive: bool = False):
    nseq = rng.randint(1, 6)
    q_lens = [rng.choice([1, 1, rng.randint(1, 40)]) for _ in range(nseq)]
    seq_lens = [q + rng.randint(0, 50) for q in q_lens]  # cached prefix + new tokens
    max_blocks = max(-(-s // bs) for s in seq_lens)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 3
    # consecutive: each sequence's blocks in order, one after the other (in-place block reads)
    perm = list(range(num_blocks)) if consecutive else torch.randperm(num_blocks).tolist()
    tables = torch.zeros(nseq, max_blocks, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[i, :n] = torch.tensor(perm[used:used + n])
        used += n
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return q_lens, seq_lens, tables, qsl, num_blocks


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_attend_matches_reference(seed, consecutive):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, kv_heads, group, d = rng.choice([4, 16]), rng.choice([1, 3]), rng.choice([1, 3]), 64
    q_lens, seq_lens, tables, qsl, num_blocks = _random_layout(rng, bs, consecutive)
    k_cache, v_cache = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    q = torch.randn(qsl[-1], kv_heads * group, d)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens), max(seq_lens),
                             qsl, seq_lens)
    ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125)
    backend = TorchAttentionBackend()
    out = backend.attend(q, k_cache, v_cache, meta, 0.125)
    assert (out - ref).abs().max() < 1e-4
    plan = backend._plan[1]
    if consecutive and plan.decode_rows == 1 and len(seq_lens) == 1:
        assert plan.gather_start is not None  # a lone decode row's in-order blocks are read in place


@pytest.mark.parametrize("with_padding", [False, True])
def test_store_kv_matches_reference(with_padding):
    torch.manual_seed(0)
    k_ref, v_ref = torch.randn(20, 16, 2, 8), torch.randn(20, 16, 2, 8)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    slots = torch.randperm(20 * 16)[:37]
    if with_padding:
        slots[[3, 17]] = -1  # padding rows (CUDA-graph style) are not stored
    key, value = torch.randn(37, 2, 8), torch.randn(37, 2, 8)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    TorchAttentionBackend().store_kv(key, value, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


def test_one_backend_over_successive_steps():
    """The per-step plan is cached on the metadata object: a new step's metadata (new lengths,
    uniform decode lengths without a mask, a single row) must not reuse the previous plan."""
    backend = TorchAttentionBackend()
    rng = random.Random(99)
    torch.manual_seed(99)
    bs, kv_heads, d = 4, 3, 64
    layouts = [_random_layout(rng, bs) for _ in range(8)]
    layouts.append(([1, 1, 1], [9, 9, 9], torch.arange(9, dtype=torch.int32).view(3, 3), [0, 1, 2, 3], 9))
    layouts.append(([1], [7], torch.tensor([[4, 2]], dtype=torch.int32), [0, 1], 6))
    for q_lens, seq_lens, tables, qsl, num_blocks in layouts:
        k_cache, v_cache = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
        q = torch.randn(qsl[-1], kv_heads * 3, d)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens), max(seq_lens),
                                 qsl, seq_lens)
        ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125)
        for _ in range(2):  # a second layer of the same step reuses the plan
            assert (backend.attend(q, k_cache, v_cache, meta, 0.125) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("seq_lens", [[9], [30, 25, 32], [12, 12]])
def test_decode_rows_on_consecutive_blocks_read_in_place(seq_lens):
    """Decode rows whose blocks are consecutive (row i owns blocks start + i * n ...) are read
    with one strided view per cache; rows shorter than the longest are masked."""
    torch.manual_seed(len(seq_lens))
    bs, kv_heads, d, start = 4, 3, 64, 2
    n = -(-max(seq_lens) // bs)
    b = len(seq_lens)
    tables = (start + torch.arange(b * n, dtype=torch.int32)).view(b, n)
    num_blocks = start + b * n + 2
    k_cache, v_cache = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    q = torch.randn(b, kv_heads * 3, d)
    qsl = list(range(b + 1))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), tables, 1, max(seq_lens), qsl, seq_lens)
    ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125)
    backend = TorchAttentionBackend()
    out = backend.attend(q, k_cache, v_cache, meta, 0.125)
    assert backend._plan[1].gather_start == start
    assert (out - ref).abs().max() < 1e-5


# (q_len of each sequence in step order, its cached tokens): a step with no decode row, one decode
# row among prompt chunks, decode rows only, and decode rows interleaved with chunks
EDGE_STEPS = {
    "no decode row": [(5, 0), (9, 3)],
    "one decode row": [(7, 0), (1, 20), (4, 4)],
    "decode rows only": [(1, 3), (1, 17), (1, 9)],
    "interleaved": [(1, 30), (6, 2), (1, 5), (3, 0), (1, 12)],
}


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("name", list(EDGE_STEPS))
def test_attend_and_attend_rows_at_the_edges(name, kernel):
    """The backend's per-step plan (decode rows vs prompt rows, the kernel's causal rows) at its edges,
    with and without the compiled kernel: attend equals the reference, and attend_rows (where the
    kernel serves every token) equals attend's rows for no row, one row, and every row reversed."""
    from minivllm.kernels import cpu_kernels
    ops = cpu_kernels.load() if kernel else None
    if kernel and ops is None:
        pytest.skip("no compiled CPU kernels")
    torch.manual_seed(len(name))
    bs, kv_heads, group, d = 4, 2, 3, 32
    q_lens = [q for q, _ in EDGE_STEPS[name]]
    seq_lens = [q + c for q, c in EDGE_STEPS[name]]
    n_blocks = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(n_blocks) + 2).tolist()
    tables = torch.zeros(len(seq_lens), max(n_blocks), dtype=torch.int32)
    for i, n in enumerate(n_blocks):
        tables[i, :n] = torch.tensor(perm[sum(n_blocks[:i]):sum(n_blocks[:i + 1])])
    k_cache, v_cache = torch.randn(len(perm), bs, kv_heads, d), torch.randn(len(perm), bs, kv_heads, d)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    q = torch.randn(qsl[-1], kv_heads * group, d)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens), max(seq_lens), qsl,
                             seq_lens)
    backend = TorchAttentionBackend()
    if ops is not None:
        backend.use_cpu_kernel(ops)
    full = backend.attend(q, k_cache, v_cache, meta, 0.2)
    ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.2)
    assert (full - ref).abs().max() < 1e-4
    t = qsl[-1]
    for rows in (torch.zeros(0, dtype=torch.int64), torch.tensor([t - 1]), torch.arange(t - 1, -1, -1)):
        got = backend.attend_rows(q, k_cache, v_cache, meta, 0.2, rows)
        if got is None:  # only the kernel serving every token of a step with prompt rows has a rows path
            assert ops is None or name == "decode rows only"
            continue
        assert torch.equal(got, full[rows])
