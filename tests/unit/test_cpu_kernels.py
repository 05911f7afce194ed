"""The compiled CPU decode-attention kernel (kernels/cpu/paged_decode_attention.cpp), every build
this CPU runs (AVX-512, AVX2 + FMA, portable), against the plain-PyTorch reference on random paged layouts;
its input checks; and the CPU backend serving decode rows with it in mixed steps."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.reference import paged_attention_reference
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.kernels import cpu_kernels


def _can_build() -> bool:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False
    cpu_kernels._ensure_ninja_on_path()
    return shutil.which("ninja") is not None


pytestmark = pytest.mark.skipif(not _can_build(), reason="needs a C++ compiler and ninja to build the CPU kernel")

VARIANTS = cpu_kernels.runnable_variants()


@pytest.fixture(scope="module", params=VARIANTS)
def ops(request):
    ops = cpu_kernels.load(request.param)
    assert ops is not None, f"the {request.param} build failed (see the log)"
    assert ops.vector_isa() == request.param
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
    out = cpu_kernels.paged_decode_attention(ops, q, k_cache, v_cache, tables,
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
    out = cpu_kernels.paged_decode_attention(ops, q, k_cache, v_cache, tables,
                                               torch.tensor(seq_lens, dtype=torch.int32), 0.125)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < 1e-4


def test_kernel_rejects_bad_inputs(ops):
    """Checked in Python before the kernel runs (a C++ exception crossing the op boundary
    crashed one torch build), with the field and the limit in the message."""
    q, k_cache, v_cache = torch.randn(2, 3, 64), torch.randn(4, 16, 1, 64), torch.randn(4, 16, 1, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 17], dtype=torch.int32)
    call = cpu_kernels.paged_decode_attention
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 4\), got \[0, 7\]"):
        call(ops, q, k_cache, v_cache, torch.tensor([[0, 1], [2, 7]], dtype=torch.int32), lens, 0.1)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 32\], got \[0, 20\]"):
        call(ops, q, k_cache, v_cache, tables, torch.tensor([20, 0], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="seq_lens"):  # more keys than the table has blocks for
        call(ops, q, k_cache, v_cache, tables, torch.tensor([20, 33], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="int32"):
        call(ops, q, k_cache, v_cache, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="float32"):
        call(ops, q.double(), k_cache, v_cache, tables, lens, 0.1)
    # after the errors the kernel still serves a valid call
    out = call(ops, q, k_cache, v_cache, tables, lens, 0.1)
    ref = paged_attention_reference(q, k_cache, v_cache, [0, 1, 2], [20, 17], tables, 0.1)
    assert (out - ref).abs().max().item() < 2e-5


def test_backend_checks_block_ids_once_per_step(ops):
    """A decode row whose table points past the cache is refused before any layer runs."""
    q, k_cache, v_cache = torch.randn(1, 3, 64), torch.randn(4, 16, 1, 64), torch.randn(4, 16, 1, 64)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([20], dtype=torch.int32), torch.tensor([[0, 9]], dtype=torch.int32), 1, 20,
                             [0, 1], [20])
    backend = TorchAttentionBackend()
    backend.use_cpu_kernel(ops)
    with pytest.raises(ValueError, match="block ids"):
        backend.attend(q, k_cache, v_cache, meta, 0.1)


@pytest.mark.parametrize("seed", range(8))
def test_backend_with_kernel_matches_reference(ops, seed):
    """Mixed steps (decode rows, whole prompts, chunks after a cached prefix): the kernel serves
    every token, a prompt token as a row over its causal prefix."""
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
    assert (backend._plan[1].causal_rows is not None) == (max(q_lens) > 1)  # one kernel call, no SDPA


# ---- fused small ops (kernels/cpu/fused_ops.cpp) ------------------------------------------


@pytest.mark.parametrize("shape", [(0, 576), (1, 576), (37, 64), (5, 100), (300, 576)])
@pytest.mark.parametrize("with_hidden", [False, True])
def test_add_rms_norm_matches_torch(ops, shape, with_hidden):
    torch.manual_seed(shape[0])
    residual, hidden, weight = torch.randn(shape), torch.randn(shape), torch.randn(shape[1])
    expected_residual = residual + hidden if with_hidden else residual.clone()
    expected = torch.nn.functional.rms_norm(expected_residual, (shape[1],), weight, 1e-5)
    out = ops.add_rms_norm(residual, hidden if with_hidden else None, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # the add happens in place, exactly
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [0, 1, 7, 40])
def test_rope_store_kv_matches_torch(ops, tokens):
    from minivllm.attention.reference import store_kv_reference
    from minivllm.kernels.fused_ops import apply_rotary_torch
    from minivllm.models.layers import RotaryEmbedding
    torch.manual_seed(tokens)
    hq, hk, d, bs = 6, 2, 64, 4
    rot = RotaryEmbedding(d, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,))
    qkv = torch.randn(tokens, (hq + 2 * hk) * d)
    slots = torch.randperm(16 * bs)[:tokens]
    if tokens > 2:
        slots[1] = -1  # not stored (padding)
    k_ref, v_ref = torch.randn(16, bs, hk, d), torch.randn(16, bs, hk, d)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    qk = qkv[:, :(hq + hk) * d].view(tokens, hq + hk, d)
    q_exp, k_exp = apply_rotary_torch(positions, qk[:, :hq], qk[:, hq:], rot.cos_sin)
    v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    store_kv_reference(k_exp, v, k_ref, v_ref, slots)
    ops.rope_store_kv(qkv, positions, rot.cos_sin, hq, hk, k_out, v_out, slots)
    out = qkv.view(tokens, hq + 2 * hk, d)
    assert torch.allclose(out[:, :hq], q_exp, atol=1e-6) and torch.allclose(out[:, hq:hq + hk], k_exp, atol=1e-6)
    assert torch.equal(out[:, hq + hk:], v)  # v is not rotated
    assert torch.allclose(k_out, k_ref, atol=1e-6) and torch.equal(v_out, v_ref)


def test_rope_store_checks_positions_and_slots():
    check = cpu_kernels.check_rope_store
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 32\), got \[0, 32\]"):
        check(torch.tensor([0, 32]), torch.tensor([0, 1]), 32, 8)
    with pytest.raises(ValueError, match=r"slot_mapping must lie in \[-1, 8\), got \[0, 8\]"):
        check(torch.tensor([0, 1]), torch.tensor([0, 8]), 32, 8)
    with pytest.raises(ValueError, match="int64"):
        check(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]), 32, 8)
    check(torch.tensor([0, 31]), torch.tensor([-1, 7]), 32, 8)  # the limits themselves are valid


@pytest.mark.parametrize("tokens,inter", [(0, 100), (1, 1536), (9, 100), (64, 48)])
def test_silu_mul_matches_torch(ops, tokens, inter):
    torch.manual_seed(tokens)
    gate_up = torch.randn(tokens, 2 * inter) * 4
    if tokens:
        gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.0, 89.0, 1e-30])  # both tails, zero, a tiny value
    expected = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = ops.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, expected, rtol=2e-6, atol=1e-6)


def test_fused_cpu_forward_matches_module_forward(ops):
    """Prefill of two prompts, then decode steps, then a lone sequence: the fused forward's
    hidden states and KV cache writes equal the module path's up to float32 rounding."""
    from minivllm.core.interfaces import ScheduledRequest
    from minivllm.models.arch import ArchConfig
    from minivllm.models.cpu_forward import CpuForward
    from minivllm.models.llama import CausalLM
    from minivllm.runner.input_batch import build_step_inputs
    d = 16 if ops.vector_isa() == "portable" else 64  # head_dim 64: the vector attention path too
    cfg = ArchConfig("LlamaForCausalLM", vocab_size=97, hidden_size=6 * d, intermediate_size=96, num_layers=3,
                     num_heads=6, num_kv_heads=2, head_dim=d, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    module_backend, fused_backend = TorchAttentionBackend(), TorchAttentionBackend()
    fused_backend.use_cpu_kernel(ops)
    model = CausalLM(cfg, module_backend, 256).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    fused = CpuForward(model, ops)
    fused.backend = fused_backend
    bs, num_blocks = 4, 16
    caches = {path: [(torch.zeros(num_blocks, bs, 2, d), torch.zeros(num_blocks, bs, 2, d)) for _ in range(3)]
              for path in ("module", "fused")}
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7, 8]}
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8, 9, 7]}
    steps = [[ScheduledRequest(r, ids, 0, [], True) for r, ids in prompts.items()]]
    for i in range(4):
        steps.append([ScheduledRequest(r, [10 + i], len(ids) + i, [], True) for r, ids in prompts.items()])
    steps.append([ScheduledRequest("b", [20], len(prompts["b"]) + 4, [], True)])
    with torch.inference_mode():
        for sched in steps:
            inputs = build_step_inputs(sched, blocks, bs, torch.device("cpu"), pin=False)
            out = {}
            for path in ("module", "fused"):
                for layer, (k, v) in zip(model.layers, caches[path]):
                    layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
                model.cpu_forward = fused if path == "fused" else None
                out[path] = model(inputs.input_ids, inputs.positions, inputs.meta)
            assert torch.allclose(out["fused"], out["module"], rtol=1e-4, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(caches["module"], caches["fused"]):
        assert torch.allclose(k1, k2, rtol=1e-4, atol=1e-4) and torch.allclose(v1, v2, rtol=1e-4, atol=1e-4)
        assert k1.abs().sum() > 0


# --- the packed-panel linear kernel (kernels/cpu/packed_linear.cpp) ---

def test_panel_width_follows_the_build(ops):
    isa = ops.vector_isa()
    assert ops.packed_panel_width() == {"avx512": 32, "avx2": 16, "portable": 0}[isa]


def _random_packed_linear(ops, rows: int, k: int, n: int, bias: bool, seed: int):
    """(w [n, k], x [rows, k], b [n] or None, w's panels); skips where the build has no packed path."""
    if ops.packed_panel_width() == 0:
        pytest.skip("no packed path in the portable build")
    torch.manual_seed(seed)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    return w, x, b, ops.pack_linear_weight(w)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 32, 47, 48, 49, 100])
@pytest.mark.parametrize("k,n,bias", [(64, 48, False), (100, 37, True), (576, 1344, False), (33, 1, True)])
def test_packed_linear_matches_f_linear(ops, rows, k, n, bias):
    """Row counts around the 6-row blocks (shared evenly: 13 rows are blocks of 5, 4, 4) and the
    48-row chunks, output widths that are not a multiple of the panel (zero-padded columns must not
    leak), with and without bias."""
    w, x, b, panels = _random_packed_linear(ops, rows, k, n, bias, seed=rows * 7 + k + n)
    p = ops.packed_panel_width()
    assert panels.shape == (-(-n // p), k, p)
    out = ops.packed_linear(x, panels, n, b)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 5, 13, 32, 49])
@pytest.mark.parametrize("k,n,bias", [(64, 48, False), (100, 37, True), (576, 3000, False), (33, 1, True)])
def test_packed_linear_argmax_matches_argmax_of_the_product(ops, rows, k, n, bias):
    """The fused argmax equals packed_linear(...).argmax(-1) exactly (same arithmetic) and F.linear's
    argmax (random inputs: no near-ties)."""
    w, x, b, panels = _random_packed_linear(ops, rows, k, n, bias, seed=rows * 11 + k + n)
    got = ops.packed_linear_argmax(x, panels, n, b)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, ops.packed_linear(x, panels, n, b).argmax(-1))
    assert torch.equal(got, torch.nn.functional.linear(x, w, b).argmax(-1))


@pytest.mark.parametrize("rows", [0, 1, 5, 13, 32, 49])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_silu_mul_equals_silu_mul_of_the_product(ops, rows, bias):
    """The gate-up epilogue gives silu_mul(packed_linear(...)) bit for bit, and torch's
    silu(gate) * up up to float32 rounding; several panels per half, rows around the blocks."""
    p = ops.packed_panel_width()
    if p == 0:
        pytest.skip("no packed path in the portable build")
    torch.manual_seed(rows + 3 * bias)
    k, n = 100, 2 * 5 * p  # 5 panels of gate columns, 5 of up
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    panels = ops.pack_linear_weight(w)
    got = ops.packed_linear_silu_mul(x, panels, n, b)
    assert got.shape == (rows, n // 2)
    assert torch.equal(got, ops.silu_mul(ops.packed_linear(x, panels, n, b)))
    ref = torch.nn.functional.linear(x, w, b)
    expected = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3 * max(1.0, float(expected.abs().max()) if rows else 1.0))


def test_packed_linear_argmax_keeps_torchs_tie_and_nan_order(ops):
    """Equal maxima in several panels (and in both threads' shares): the lowest column wins; a NaN
    logit wins over every number, the first NaN over later ones (torch.argmax's order)."""
    if ops.packed_panel_width() == 0:
        pytest.skip("no packed path in the portable build")
    torch.manual_seed(0)
    n = 8 * ops.packed_panel_width() + 3
    w = torch.randn(n, 64)
    w[5, 1] = -1.0  # so that rows 0 and 1 give column n - 1 a logit of -inf (below)
    w[n - 2] = w[n // 2] = w[5]  # columns 5, n/2, n-2 give the same, largest, logit for x = w[5]
    w[n - 1] = 0.0
    w[n - 1, 1] = float("inf")
    x = w[5].repeat(4, 1)
    x[2, 0] = float("nan")  # row 2: every logit NaN -> column 0
    x[3, 1] = 1.0  # row 3: column n - 1 gets +inf
    panels = ops.pack_linear_weight(w)
    got = ops.packed_linear_argmax(x, panels, n, None)
    assert got.tolist() == torch.nn.functional.linear(x, w).argmax(-1).tolist()
    assert got[:2].tolist() == [5, 5] and got[2] == 0 and got[3] == n - 1


def _screened(ops, x, w, b, panels, max_candidates=None):
    """screened_argmax with w's screen (models/cpu_linear.py); skips where the build has none."""
    from minivllm.models.cpu_linear import screen_weight_stats
    if ops.packed_panel_width() == 0 or not ops.screened_argmax_available():
        pytest.skip("no int8 screen in this build")
    n = w.shape[0]
    cap = n if max_candidates is None else max_candidates
    return ops.screened_argmax(x, *screen_weight_stats(w, b), w.contiguous(), panels, n, b, cap)


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 17, 32])
@pytest.mark.parametrize("k,n,bias", [(64, 48, False), (96, 37, True), (576, 3000, False)])
def test_screened_argmax_equals_the_exact_kernel(ops, rows, k, n, bias):
    """The int8 screen then the exact products of its candidates give packed_linear_argmax's answer
    exactly: rows around the 4-row blocks, widths that are not a multiple of 16, with and without
    bias, and rows whose features differ in scale by 50x (the group scales' case)."""
    w, x, b, panels = _random_packed_linear(ops, rows, k, n, bias, seed=rows * 13 + k + n)
    x[:, ::7] *= 50.0
    got = _screened(ops, x, w, b, panels)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, ops.packed_linear_argmax(x, panels, n, b))


def test_screened_argmax_same_answer_on_any_thread_count(ops):
    """The threads take chunks of panels from a shared counter, each into its own candidate lists:
    the answer must not depend on how many threads there are or which chunks each one took. A wide
    head (1,250 panels, many chunks) and 64 rows whose best columns lie all over it, the upper
    half of the columns included."""
    w, x, b, panels = _random_packed_linear(ops, 64, 64, 20000, True, seed=21)
    w[15000:] *= 1.5  # the upper half wins most rows
    panels = ops.pack_linear_weight(w)
    expected = ops.packed_linear_argmax(x, panels, 20000, b)
    assert (expected >= 10000).sum() > 32
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(_screened(ops, x, w, b, panels), expected)
    finally:
        torch.set_num_threads(threads)


def test_screened_argmax_decides_near_ties_by_the_exact_product(ops):
    """Columns the int8 screen cannot tell apart: copies of the best column moved by less than one
    quantization step (some by 1 ulp), and an exact copy (the lower column must win the tie). The
    screen has to keep all of them as candidates, and the fp32 products pick the same column as
    the exact kernel."""
    torch.manual_seed(5)
    n, k = 400, 64
    w = torch.randn(n, k)
    x = torch.randn(6, k)
    best = ops.packed_linear(x, ops.pack_linear_weight(w), n, None).argmax(-1) if ops.packed_panel_width() else None
    if best is None:
        pytest.skip("no packed path in the portable build")
    for r in range(6):  # near copies of row r's best column, spread over several panels
        src = w[int(best[r])].clone()
        for j, col in enumerate(range(10 + 60 * r, 10 + 60 * r + 5)):
            w[col] = src
            w[col, j] = torch.nextafter(src[j], torch.tensor(float("inf")) if j % 2 else torch.tensor(-float("inf")))
        w[10 + 60 * r + 5] = src  # an exact copy: a tie
    panels = ops.pack_linear_weight(w)
    got = _screened(ops, x, w, None, panels)
    assert torch.equal(got, ops.packed_linear_argmax(x, panels, n, None))


def test_screened_argmax_hands_hard_rows_to_the_exact_kernel(ops):
    """Rows with NaN or inf (torch's argmax order must hold), an all-zero row (every logit ties: column
    0), and a candidate cap of 0 (every row falls back) all give packed_linear_argmax's answer."""
    w, x, b, panels = _random_packed_linear(ops, 6, 64, 100, False, seed=9)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 0.0
    expected = ops.packed_linear_argmax(x, panels, 100, None)
    assert torch.equal(_screened(ops, x, w, None, panels), expected)
    assert torch.equal(_screened(ops, x, w, None, panels, max_candidates=0), expected)
    assert expected[3] == 0


def _affine_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] float32 weights that are exactly d * q + m per block of 32 along k, as dequantized
    from 4-bit blocks: d a float16 value, q in [0, 15] with 0 and 15 in every block, m (the
    block's minimum) a float16 value."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 32
    d = (torch.rand(blocks, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (torch.randn(blocks, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (blocks, 32), generator=g).float()
    q[:, 0], q[:, 1] = 0, 15
    return (d * q + m).view(n, k)


@pytest.mark.parametrize("rows", [0, 1, 2, 4, 5, 9])
@pytest.mark.parametrize("k,n,bias", [(64, 48, False), (96, 37, True), (576, 960, False)])
def test_affine_block_linear_equals_the_panel_kernel(ops, rows, k, n, bias):
    """Weights that are exact 4-bit affine blocks: affine_blocks_of finds them and
    affine_block_linear gives packed_linear's results bit for bit (widths not a multiple of 16,
    rows over the 4-row passes, with and without bias)."""
    if ops.packed_panel_width() == 0 or not ops.affine_block_linear_available():
        pytest.skip("no affine-block path in this build")
    w = _affine_weight(n, k, seed=rows + k + n)
    torch.manual_seed(rows)
    x, b = torch.randn(rows, k), (torch.randn(n) if bias else None)
    q, d, m = ops.affine_blocks_of(w)
    assert q.shape == (-(-n // 16), k, 16) and d.shape == m.shape == (-(-n // 16), k // 32, 16)
    assert torch.equal(ops.affine_block_linear(x, q, d, m, n, b), ops.packed_linear(x, ops.pack_linear_weight(w), n, b))


def test_affine_blocks_of_refuses_weights_that_are_not_exact_blocks(ops):
    """A random float32 weight, one changed weight in an exact one, or K not a multiple of 32: no
    blocks (empty tensors), so the engine keeps the plain panels."""
    if not ops.affine_block_linear_available():
        pytest.skip("no affine-block path in this build")
    assert ops.affine_blocks_of(torch.randn(32, 64))[0].numel() == 0
    w = _affine_weight(32, 64, seed=1)
    assert ops.affine_blocks_of(w)[0].numel() > 0
    w[7, 40] = torch.nextafter(w[7, 40], torch.tensor(1.0))
    assert ops.affine_blocks_of(w)[0].numel() == 0
    assert ops.affine_blocks_of(_affine_weight(16, 96, seed=2)[:, :80].contiguous())[0].numel() == 0


def test_packed_linear_reads_strided_rows(ops):
    """x as a column slice of a wider tensor (rows strided, elements contiguous)."""
    if ops.packed_panel_width() == 0:
        pytest.skip("no packed path in the portable build")
    torch.manual_seed(3)
    wide, w = torch.randn(9, 80), torch.randn(20, 64)
    x = wide[:, 8:72]
    out = ops.packed_linear(x, ops.pack_linear_weight(w), 20, None)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)


def test_packed_module_runs_the_panels_and_keeps_tied_weights(ops):
    """PackedLinear on the kernel: the panels are what runs (a changed plain weight does not
    change the result), the tied weight stays the same Parameter, and a wrong input width is a
    ValueError naming both widths."""
    from torch import nn
    from minivllm.models.cpu_linear import PackedLinear, pack_linears
    if ops.packed_panel_width() == 0:
        pytest.skip("no packed path in the portable build")
    torch.manual_seed(4)
    model = nn.Module()
    model.embed = nn.Embedding(50, 24)
    model.head = nn.Linear(24, 50, bias=False)
    model.head.weight = model.embed.weight
    model.proj = nn.Linear(24, 24)
    x = torch.randn(2, 3, 24)  # leading dims are kept
    with torch.inference_mode():
        ref_head, ref_proj = model.head(x), model.proj(x)
        assert pack_linears(model, ops=ops) == 2
        assert isinstance(model.head, PackedLinear) and model.head.panels is not None
        assert model.head.weight is model.embed.weight
        torch.testing.assert_close(model.proj(x), ref_proj, rtol=1e-5, atol=1e-5)
        model.head.weight.data.mul_(2)
        torch.testing.assert_close(model.head(x), ref_head, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="23 features, expected 24"):
            model.proj(torch.randn(4, 23))


def test_kernel_linear_choice(ops, monkeypatch):
    """The panel kernel runs the linears on AMD CPUs (measured faster there), oneDNN on others;
    MINIVLLM_CPU_LINEAR_KERNEL forces it either way, MINIVLLM_CPU_PACKED_LINEAR=0 switches it
    off, and a build without the packed path never selects it."""
    from minivllm.models import cpu_linear
    monkeypatch.delenv(cpu_linear.KERNEL_ENV_FLAG, raising=False)
    monkeypatch.delenv(cpu_linear.ENV_FLAG, raising=False)
    has_path = ops.packed_panel_width() > 0
    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_linear.kernel_linear_preferred(ops) == has_path
    assert not cpu_linear.kernel_linear_preferred(None)
    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: "GenuineIntel")
    assert not cpu_linear.kernel_linear_preferred(ops)
    monkeypatch.setenv(cpu_linear.KERNEL_ENV_FLAG, "1")
    assert cpu_linear.kernel_linear_preferred(ops) == has_path
    monkeypatch.setenv(cpu_linear.ENV_FLAG, "0")
    assert not cpu_linear.kernel_linear_preferred(ops)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_waited_on(tmp_path):
    """A build lock left by a process killed mid-build is removed (torch would wait on it forever);
    a fresh one, another process building now, is waited on until it goes."""
    import os
    import threading
    import time
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * cpu_kernels.STALE_LOCK_S
    os.utime(lock, (old, old))
    cpu_kernels._wait_for_build_lock(tmp_path)
    assert not lock.exists()
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the other build finishes
    t = time.perf_counter()
    cpu_kernels._wait_for_build_lock(tmp_path, poll=0.05)
    assert not lock.exists() and time.perf_counter() - t >= 0.25
    cpu_kernels._wait_for_build_lock(tmp_path)  # no lock: returns at once


def test_kernel_over_zero_rows(ops):
    """A step may hand the kernel no query rows at all (attend_rows of a step where nothing samples)."""
    k_cache = torch.randn(4, 16, 2, 64)
    out = cpu_kernels.paged_decode_attention(ops, torch.randn(0, 6, 64), k_cache, k_cache.clone(),
                                             torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                             0.125)
    assert out.shape == (0, 6, 64)
