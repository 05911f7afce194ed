"""The compiled CPU decode-attention kernel (kernels/cpu/paged_decode_attention.cpp), both its
AVX-512 and its portable build, against the plain-PyTorch reference on random paged layouts;
its input checks; and the CPU backend serving decode rows with it in mixed steps."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import paged_attention_reference
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.kernels import cpu_attention


def _can_build() -> bool:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False
    cpu_attention._ensure_ninja_on_path()
    return shutil.which("ninja") is not None


pytestmark = pytest.mark.skipif(not _can_build(), reason="needs a C++ compiler and ninja to build the CPU kernel")

VARIANTS = ["portable"] + (["avx512"] if cpu_attention.cpu_has_avx512() else [])


@pytest.fixture(scope="module", params=VARIANTS)
def ops(request):
    ops = cpu_attention.load(request.param)
    assert ops is not None, f"the {request.param} build failed (see the log)"
    assert ops.has_avx512_path() == (request.param == "avx512")
    return ops


def _random_decode_case(rng: random.Random, d: int, group: int):
    b = rng.randint(1, 9)
    bs = rng.choice([4, 16])
    kv_heads = rng.choice([1, 2, 3])
    # lengths of 1, block multiples and block multiples plus one are the edge cases of the loops
    seq_lens = [rng.choice([1, bs, bs + 1, rng.randint(1, 300)]) for _ in range(b)]
    max_blocks = max(-(-s // bs) for s in seq_lens) + rng.randint(0, 2)  # padded tables
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 5
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(b, max_blocks, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    k_cache, v_cache = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    # the query as a view of a wider qk tensor, as the CPU forward hands it over: rows strided
    qk = torch.randn(b, kv_heads * group + kv_heads, d)
    return qk[:, :kv_heads * group], k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize("d,group", [(64, 1), (64, 3), (64, 8), (128, 4), (128, 2), (32, 3), (64, 16)])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_reference(ops, d, group, seed):
    rng = random.Random(seed * 100 + d + group)
    torch.manual_seed(seed)
    q, k_cache, v_cache, tables, seq_lens = _random_decode_case(rng, d, group)
    qsl = list(range(len(seq_lens) + 1))
    scale = d ** -0.5
    ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, scale)
    out = cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, tables,
                                               torch.tensor(seq_lens, dtype=torch.int32), scale)
    assert out.shape == q.shape
    assert (out - ref).abs().max().item() < 2e-5


def test_kernel_softmax_with_large_score_range(ops):
    """Scores spread over hundreds: exp of (score - max) underflows for most keys; the result
    must still be the reference's (no NaN, no division by a zero sum)."""
    torch.manual_seed(5)
    q, k_cache, v_cache, tables, seq_lens = _random_decode_case(random.Random(5), 64, 3)
    q = q * 40.0
    ref = paged_attention_reference(q, k_cache, v_cache, list(range(len(seq_lens) + 1)), seq_lens, tables, 0.125)
    out = cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, tables,
                                               torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < 1e-4


def test_kernel_rejects_bad_inputs(ops):
    q, k_cache, v_cache = torch.randn(2, 3, 64), torch.randn(4, 16, 1, 64), torch.randn(4, 16, 1, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 17], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 7"):
        cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, torch.tensor([[0, 1], [2, 7]], dtype=torch.int32),
                                             lens, 0.1)
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, tables, torch.tensor([20, 0], dtype=torch.int32),
                                             0.1)
    with pytest.raises(RuntimeError, match="seq_lens"):  # more keys than the table has blocks for
        cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, tables, torch.tensor([20, 33], dtype=torch.int32),
                                             0.1)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, tables.long(), lens, 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_attention.paged_decode_attention(ops, q.double(), k_cache, v_cache, tables, lens, 0.1)
    # after the errors the kernel still serves a valid call
    out = cpu_attention.paged_decode_attention(ops, q, k_cache, v_cache, tables, lens, 0.1)
    ref = paged_attention_reference(q, k_cache, v_cache, [0, 1, 2], [20, 17], tables, 0.1)
    assert (out - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("seed", range(8))
def test_backend_with_kernel_matches_reference(ops, seed):
    """Mixed steps: the kernel serves the one-token rows, SDPA the prefill rows."""
    rng = random.Random(1000 + seed)
    torch.manual_seed(seed)
    bs, kv_heads, group, d = rng.choice([4, 16]), rng.choice([1, 3]), rng.choice([1, 3]), 64
    nseq = rng.randint(1, 7)
    q_lens = [rng.choice([1, 1, rng.randint(2, 40)]) for _ in range(nseq)]
    seq_lens = [q + rng.randint(0, 60) for q in q_lens]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(nseq, max_blocks, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    k_cache, v_cache = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    q = torch.randn(qsl[-1], kv_heads * group, d)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), tables, max(q_lens), max(seq_lens),
                             qsl, seq_lens)
    ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, 0.125)
    backend = TorchAttentionBackend()
    backend.use_cpu_kernel(ops)
    assert (backend.attend(q, k_cache, v_cache, meta, 0.125) - ref).abs().max().item() < 1e-4
