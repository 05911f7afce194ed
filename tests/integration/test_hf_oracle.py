"""minivllm against Hugging Face transformers on the same GGUF weights, fp32 on the CPU:
greedy tokens equal token for token, under every scheduling path."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

MAX_NEW = 32  # same as conftest.MAX_NEW

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _prompts(ids):
    return [{"prompt_token_ids": p} for p in ids]


def _assert_same_as_hf(outs, hf_greedy):
    for i, (o, ref) in enumerate(zip(outs, hf_greedy)):
        got = o.outputs[0].token_ids
        assert got == ref, f"prompt {i}: minivllm {got} != HF {ref}"


def test_batch_greedy_equals_hf(llm, chat_token_ids, hf_greedy):
    outs = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    _assert_same_as_hf(outs, hf_greedy)
    # the model stops on its own eos for some prompts: finish reasons follow the tokens
    for o, ref in zip(outs, hf_greedy):
        assert o.outputs[0].finish_reason == ("length" if len(ref) == MAX_NEW and ref[-1] != 2 else "stop")


def test_chunked_prefill_equals_hf(chat_token_ids, hf_greedy):
    llm = LLM(dtype="float32", device="cpu", max_num_batched_tokens=48, enable_prefix_caching=False)
    sched = llm.llm_engine.scheduler
    outs = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    _assert_same_as_hf(outs, hf_greedy)
    assert sched.limits.max_num_batched_tokens < max(len(p) for p in chat_token_ids)


def test_preemption_equals_hf(chat_token_ids, hf_greedy):
    longest = max(len(p) for p in chat_token_ids) + MAX_NEW
    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=longest // 16 + 8, enable_prefix_caching=False)
    outs = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    _assert_same_as_hf(outs, hf_greedy)
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_prefix_cache_second_run_hits(chat_token_ids, hf_greedy):
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=True)
    bm = llm.llm_engine.block_manager
    first = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    hits_before = bm.prefix_hits
    second = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    assert bm.prefix_hits - hits_before >= sum(len(p) // 16 * 16 - 16 for p in chat_token_ids)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 32)
    _assert_same_as_hf(second, hf_greedy)


def test_n3_seeded_sampling_reproducible(llm, chat_token_ids):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    a = llm.generate(_prompts(chat_token_ids[:4]), params, use_tqdm=False)
    b = llm.generate(_prompts(chat_token_ids[:4]), params, use_tqdm=False)
    for x, y in zip(a, b):
        assert len(x.outputs) == 3
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
    # the three samples of a prompt are different draws
    assert any(len({tuple(c.token_ids) for c in x.outputs}) > 1 for x in a)
    # the same seed alone (n=1) reproduces sample 0, whatever else shares the batch
    solo = llm.generate(_prompts(chat_token_ids[:1]), SamplingParams(temperature=0.9, top_p=0.95, seed=1234,
                                                                     max_tokens=16), use_tqdm=False)
    assert solo[0].outputs[0].token_ids == a[0].outputs[0].token_ids


def test_n3_shares_prompt_blocks(chat_token_ids):
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=False)
    engine = llm.llm_engine
    long_prompt = max(chat_token_ids, key=len)
    engine.add_request("r", {"prompt_token_ids": long_prompt}, SamplingParams(n=3, temperature=1.0, max_tokens=8))
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        tables = list(engine.block_manager.req_blocks.values())
        if len(tables) == 3:
            shared_seen |= len({b.block_id for b in tables[0]} & {b.block_id for b in tables[1]}) >= len(long_prompt) // 16
    assert shared_seen, "the 3 samples should share the prompt's full KV blocks"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_match_hf(llm, hf_model, chat_token_ids):
    prompt = chat_token_ids[0]
    out = llm.generate(_prompts([prompt]), SamplingParams(temperature=0.0, max_tokens=4, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    seq = list(prompt)
    with torch.no_grad():
        for step, tok in enumerate(out.token_ids):
            ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0, -1].double(), -1)
            top = torch.topk(ref, 5)
            lp = out.logprobs[step]
            for tid, val in zip(top.indices.tolist(), top.values.tolist()):
                assert tid in lp, f"step {step}: HF top-5 token {tid} missing"
                assert abs(lp[tid].logprob - val) < 1e-3
            assert lp[tok].rank == 1
            seq.append(tok)
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)))


def test_async_scheduling_with_preemption_equals_hf(chat_token_ids, hf_greedy):
    """One step in flight (placeholder tokens filled on the device, stop checks one step late),
    under chunked prefill and preemption: the tokens must not change."""
    longest = max(len(p) for p in chat_token_ids) + MAX_NEW
    llm = LLM(dtype="float32", device="cpu", async_scheduling=True, max_num_batched_tokens=256,
              num_kv_blocks=longest // 16 + 8)
    outs = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_same_as_hf(outs, hf_greedy)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # seeded sampling gives the same tokens with and without a step in flight
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, min_tokens=4)
    sync = LLM(dtype="float32", device="cpu", async_scheduling=False)
    a = llm.generate(_prompts(chat_token_ids[:3]), params, use_tqdm=False)
    b = sync.generate(_prompts(chat_token_ids[:3]), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # penalties need every past token on the host: those steps run synchronously, same tokens
    penalized = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.5)
    a = llm.generate(_prompts(chat_token_ids[:3]), penalized, use_tqdm=False)
    b = sync.generate(_prompts(chat_token_ids[:3]), penalized, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_fused_greedy_lm_head_equals_hf(monkeypatch, chat_token_ids, hf_greedy):
    """With the panel kernel forced on, an all-greedy batch takes its tokens from the LM head's
    fused argmax (no logits) and still equals HF; a batch asking for logprobs takes the logits
    path in the same engine and gives the same tokens; single prompts (the int8 screen and the
    affine blocks, where the build has them) too."""
    from minivllm.kernels import cpu_kernels
    ops = cpu_kernels.load()
    if ops is None or ops.packed_panel_width() == 0:
        pytest.skip("no panel kernel in this build")
    monkeypatch.setenv("MINIVLLM_CPU_LINEAR_KERNEL", "1")
    llm = LLM(dtype="float32", device="cpu")
    model = llm.llm_engine.executor.runner.model
    fused_calls = []
    argmax_rows = model.lm_head.argmax_rows
    monkeypatch.setattr(model.lm_head, "argmax_rows", lambda x: fused_calls.append(x.shape[0]) or argmax_rows(x))
    outs = llm.generate(_prompts(chat_token_ids), GREEDY, use_tqdm=False)
    _assert_same_as_hf(outs, hf_greedy)
    assert model.lm_head.panels is not None and len(fused_calls) >= MAX_NEW
    calls_before = len(fused_calls)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1)
    outs = llm.generate(_prompts(chat_token_ids), with_logprobs, use_tqdm=False)
    _assert_same_as_hf(outs, hf_greedy)
    assert len(fused_calls) == calls_before
    # few-row steps: the LM head's int8 screen and the decoder's exact 4-bit affine blocks (the
    # bundled GGUF's linears are Q4_1), one prompt at a time, still equal HF
    if ops.screened_argmax_available() and ops.affine_block_linear_available():
        assert model.lm_head.screen is not None
        assert all(layer.mlp.down_proj.affine is not None for layer in model.layers)
        for i in (0, len(chat_token_ids) - 1):
            outs = llm.generate(_prompts(chat_token_ids[i:i + 1]), GREEDY, use_tqdm=False)
            _assert_same_as_hf(outs, hf_greedy[i:i + 1])
