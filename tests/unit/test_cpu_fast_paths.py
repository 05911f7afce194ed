"""CPU float32 fast paths of the layers against the plain torch math they replace."""

import pytest
import torch

from minivllm.kernels.fused_ops import apply_rotary_torch, fused_add_rms_norm, rms_norm
from minivllm.models.layers import RotaryEmbedding


def _reference_rms_norm(x, weight, eps):  # the eight-op math (HF's order), as in rms_norm_torch
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (33, 960), (5, 9, 64)])
def test_cpu_rms_norm_is_bit_identical(shape):
    torch.manual_seed(shape[0])
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    assert torch.equal(rms_norm(x, w, 1e-5), _reference_rms_norm(x, w, 1e-5))
    r = torch.randn(shape)
    y, s = fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r) and torch.equal(y, _reference_rms_norm(x + r, w, 1e-5))


def test_cpu_rms_norm_keeps_the_upcast_for_bf16():
    torch.manual_seed(0)
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), _reference_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("tokens", [1, 6])
def test_rotate_qk_cpu_is_bit_identical_and_tracks_positions(tokens):
    torch.manual_seed(tokens)
    rot = RotaryEmbedding(64, 512, 10000.0, None)
    hq, hk = 9, 3
    for start in (0, 300):  # a new positions tensor (the next step) must not reuse cos/sin
        positions = torch.arange(start, start + tokens)
        qk = torch.randn(tokens, hq + hk, 64)
        q_ref, k_ref = apply_rotary_torch(positions, qk[:, :hq], qk[:, hq:], rot.cos_sin)
        out = rot.rotate_qk_cpu(positions, qk)
        assert torch.equal(out[:, :hq], q_ref) and torch.equal(out[:, hq:], k_ref)


# ------------------------------------------------------------------ models/cpu_forward.py


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (33, 960), (200, 64)])
def test_cpu_forward_rms_norm_is_bit_identical(shape):
    from minivllm.models.cpu_forward import rms_norm_
    torch.manual_seed(shape[0])
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    x_before = x.clone()
    assert torch.equal(rms_norm_(x, w, 1e-5), _reference_rms_norm(x, w, 1e-5))
    assert torch.equal(x, x_before)  # the input is not modified


@pytest.mark.parametrize("tokens", [1, 5, 130])
def test_cpu_forward_rotate_is_bit_identical(tokens):
    from minivllm.models.cpu_forward import rotary_tables, rotate
    torch.manual_seed(tokens)
    rot = RotaryEmbedding(64, 4096, 100000.0, None)
    hq, hk = 9, 3
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (hq + 2 * hk) * 64)  # rotate a strided view, as the layer does
    qk = qkv[:, :(hq + hk) * 64].view(tokens, hq + hk, 64)
    q_ref, k_ref = apply_rotary_torch(positions, qk[:, :hq], qk[:, hq:], rot.cos_sin)
    out = rotate(qk, *rotary_tables(rot.cos_sin, positions))
    assert torch.equal(out[:, :hq], q_ref) and torch.equal(out[:, hq:], k_ref)


def _tiny_model(qk_norm=False):
    from minivllm.attention.torch_backend import TorchAttentionBackend
    from minivllm.models.arch import ArchConfig
    from minivllm.models.llama import CausalLM
    cfg = ArchConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                     num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False, qk_norm=qk_norm)
    torch.manual_seed(0)
    model = CausalLM(cfg, TorchAttentionBackend(), 256).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def _run_steps(model, steps, blocks, bs, caches, forward):
    """Each scheduled step once per path of `caches` (path -> per-layer (k, v) caches), each path
    on its own caches: [(sched, inputs, {path: forward(path, inputs)})]."""
    from minivllm.runner.input_batch import build_step_inputs
    results = []
    with torch.inference_mode():
        for sched in steps:
            inputs = build_step_inputs(sched, blocks, bs, torch.device("cpu"), pin=False)
            out = {}
            for path, layer_caches in caches.items():
                for layer, (k, v) in zip(model.layers, layer_caches):
                    layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
                out[path] = forward(path, inputs)
            results.append((sched, inputs, out))
    return results


@pytest.mark.parametrize("packed", [False, True])
def test_cpu_forward_equals_module_forward(packed):
    """Prefill of two prompts, then decode steps: the fast forward's hidden states and KV cache
    writes are bit-identical to the module path's."""
    from minivllm.core.interfaces import ScheduledRequest
    from minivllm.models.cpu_forward import CpuForward
    from minivllm.models.cpu_linear import pack_linears
    model = _tiny_model()
    if packed:
        pack_linears(model)
    fast, bs, num_blocks = CpuForward(model), 4, 16
    caches = {}
    for path in ("module", "fast"):
        caches[path] = [(torch.zeros(num_blocks, bs, 2, 16), torch.zeros(num_blocks, bs, 2, 16)) for _ in range(3)]
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7, 8]}
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8, 9, 7]}
    steps = [[ScheduledRequest(r, ids, 0, [], True) for r, ids in prompts.items()]]
    for i in range(4):  # decode steps: one token each
        steps.append([ScheduledRequest(r, [10 + i], len(ids) + i, [], True) for r, ids in prompts.items()])
    steps.append([ScheduledRequest("b", [20], len(prompts["b"]) + 4, [], True)])  # a lone sequence
    def forward(path, inputs):
        model.cpu_forward = fast if path == "fast" else None
        return model(inputs.input_ids, inputs.positions, inputs.meta)

    for _, _, out in _run_steps(model, steps, blocks, bs, caches, forward):
        assert torch.equal(out["fast"], out["module"])
    for (k1, v1), (k2, v2) in zip(caches["module"], caches["fast"]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and k1.abs().sum() > 0


@pytest.mark.parametrize("packed", [False, True])
def test_fused_forward_output_rows_equal_the_full_forward_rows(packed):
    """With output_rows (the tokens that sample) the compiled-kernel forward runs the last layer's
    attention, o-proj and MLP for those rows only: they equal the full forward's rows (bit for
    bit on the panel kernel, whose rows are independent; within float32 rounding on F.linear,
    whose GEMM sums in an order that depends on the row count), and every token's K/V is still
    written. Steps: two prompts; a decode row beside a new prompt; decode only; a prompt chunk
    that samples nothing (zero rows: the long-prompt bug of issue 17) and one beside a decode row
    (one row). Rows asked for: the sampling ones, none, the first, every token reversed."""
    from minivllm.core.interfaces import ScheduledRequest
    from minivllm.kernels import cpu_kernels
    from minivllm.models.cpu_forward import CpuForward
    from minivllm.models.cpu_linear import pack_linears
    ops = cpu_kernels.load()
    if ops is None:
        pytest.skip("no compiled CPU kernels")
    model = _tiny_model()
    if packed:
        pack_linears(model, ops=ops)
    model.layers[0].self_attn.backend.use_cpu_kernel(ops)
    fast, bs, num_blocks = CpuForward(model, ops), 4, 24
    paths = ("full", "rows", "none", "first", "reversed")
    caches = {path: [(torch.zeros(num_blocks, bs, 2, 16), torch.zeros(num_blocks, bs, 2, 16)) for _ in range(3)]
              for path in paths}
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7, 8], "c": [9, 10, 11, 12], "d": [13, 14, 15, 16]}
    a, b, c, d = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8], [6, 2, 8, 3, 1, 8, 5]
    steps = [[ScheduledRequest("a", a, 0, [], True), ScheduledRequest("b", b, 0, [], True)],
             [ScheduledRequest("a", [11], len(a), [], True), ScheduledRequest("c", c, 0, [], True)],
             [ScheduledRequest("a", [12], len(a) + 1, [], True), ScheduledRequest("c", [13], len(c), [], True)],
             [ScheduledRequest("d", d[:4], 0, [], False)],  # a chunk that samples nothing
             [ScheduledRequest("a", [14], len(a) + 2, [], True), ScheduledRequest("d", d[4:6], 4, [], False)]]
    def forward(path, inputs):
        t = inputs.input_ids.shape[0]
        rows = {"full": None, "rows": inputs.logits_indices, "none": torch.zeros(0, dtype=torch.int64),
                "first": torch.zeros(1, dtype=torch.int64), "reversed": torch.arange(t - 1, -1, -1)}[path]
        return fast.forward(inputs.input_ids, inputs.positions, inputs.meta, rows)

    for sched, inputs, out in _run_steps(model, steps, blocks, bs, caches, forward):
        assert out["rows"].shape == (sum(s.samples for s in sched), 64)
        assert out["none"].shape == (0, 64)
        # the rows asked for; and every token, in another order: the rows come back in that order
        for got, expected in ((out["rows"], out["full"][inputs.logits_indices]), (out["first"], out["full"][:1]),
                              (out["reversed"], out["full"].flip(0))):
            if packed:
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for other in paths[1:]:
        for (k1, v1), (k2, v2) in zip(caches["full"], caches[other]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2) and k1.abs().sum() > 0


@pytest.mark.parametrize("path", ["module", "fast"])
def test_output_rows_at_the_edges_on_the_plain_paths(path):
    """CausalLM.forward(output_rows=...) on the module path and on CpuForward without the kernels
    (the GPU's and the fallback's paths): no row, one row and every row reversed are the full
    forward's rows, also for a step of a prompt chunk that samples nothing."""
    from minivllm.core.interfaces import ScheduledRequest
    from minivllm.models.cpu_forward import CpuForward
    model = _tiny_model()
    model.cpu_forward = CpuForward(model) if path == "fast" else None
    bs, num_blocks = 4, 16
    caches = {p: [(torch.zeros(num_blocks, bs, 2, 16), torch.zeros(num_blocks, bs, 2, 16)) for _ in range(3)]
              for p in ("full", "none", "first", "reversed")}
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    steps = [[ScheduledRequest("a", [3, 1, 4, 1, 5], 0, [], True), ScheduledRequest("b", [9, 2, 6], 0, [], False)],
             [ScheduledRequest("a", [7], 5, [], True), ScheduledRequest("b", [5, 3, 5, 8], 3, [], True)],
             [ScheduledRequest("a", [8], 6, [], True)]]
    def forward(which, inputs):
        t = inputs.input_ids.shape[0]
        rows = {"full": None, "none": torch.zeros(0, dtype=torch.int64), "first": torch.zeros(1, dtype=torch.int64),
                "reversed": torch.arange(t - 1, -1, -1)}[which]
        return model(inputs.input_ids, inputs.positions, inputs.meta, output_rows=rows)

    for _, _, out in _run_steps(model, steps, blocks, bs, caches, forward):
        assert out["none"].shape == (0, 64)
        assert torch.equal(out["first"], out["full"][:1]) and torch.equal(out["reversed"], out["full"].flip(0))


def test_cpu_forward_is_not_enabled_with_qk_norm_or_switched_off(monkeypatch):
    from minivllm.models.cpu_forward import ENV_FLAG, enable_cpu_forward
    assert not enable_cpu_forward(_tiny_model(qk_norm=True))
    monkeypatch.setenv(ENV_FLAG, "0")
    model = _tiny_model()
    assert not enable_cpu_forward(model) and model.cpu_forward is None
    monkeypatch.delenv(ENV_FLAG)
    assert enable_cpu_forward(model) and model.cpu_forward is not None
