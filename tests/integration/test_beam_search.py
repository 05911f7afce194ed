"""Beam search against Hugging Face `generate(num_beams=4, do_sample=False)` on the same weights,
fp32 on the CPU; beams share KV blocks; bad beam parameters are refused.

HF and vLLM normalise scores differently (HF divides by the generated length, vLLM by prompt +
output): with length_penalty=0 both rank by the cumulative logprob, and HF's early_stopping=False
stops only when no running beam can still beat the finished ones, which then is vLLM's rule too
(logprobs only lower a beam's score)."""

from __future__ import annotations

import copy

import pytest
import torch

from minivllm import LLM, BeamSearchParams

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def hf_beams(hf_model, llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    config = copy.deepcopy(hf_model.generation_config)
    config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p)["input_ids"]
            g = hf_model.generate(torch.tensor([ids]), generation_config=config, max_new_tokens=MAX_NEW,
                                  do_sample=False, num_beams=4, num_return_sequences=4, length_penalty=1.0,
                                  return_dict_in_generate=True, output_scores=True, pad_token_id=0)
            # HF's score: cum_logprob / generated length ** length_penalty
            outs.append([(s[len(ids):].tolist(), float(sc) * MAX_NEW) for s, sc in zip(g.sequences, g.sequences_scores)])
    return outs


def test_beams_equal_hf(llm, hf_beams):
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True))
    tok = llm.get_tokenizer()
    for p, out, ref in zip(PROMPTS, outs, hf_beams):
        prompt_len = len(tok(p)["input_ids"])
        assert len(out.sequences) == 4
        got = [s.tokens[prompt_len:] for s in out.sequences]
        assert got == [r[0] for r in ref], f"{p!r}: minivllm {got} != HF {[r[0] for r in ref]}"
        for s, (_, cum) in zip(out.sequences, ref):
            assert abs(s.cum_logprob - cum) < 1e-3
        best = out.sequences[0]
        assert best.text == tok.decode(best.tokens[prompt_len:], skip_special_tokens=True)
        assert best.tokens[:prompt_len] == tok(p)["input_ids"] and best.finish_reason == "length"


def test_beams_share_blocks():
    """Beams fork by copying block tables: while a long prompt's 4 beams run, the cache holds far
    fewer blocks than 4 private copies of the prompt would need."""
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=False)
    engine = llm.llm_engine
    bm, bs = engine.block_manager, engine.config.cache.block_size
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    n_prompt = len(llm.get_tokenizer()(prompt)["input_ids"])
    engine.add_request("b", prompt, BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))
    peak_used, peak_beams = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        beams = [r for r in engine.scheduler.running if r.beam is not None]
        peak_beams = max(peak_beams, len(beams))
        peak_used = max(peak_used, bm.num_blocks - bm.num_free_blocks)
    assert peak_beams == 4
    private = 4 * (n_prompt + 8 + bs - 1) // bs
    shared = n_prompt // bs + 4 * 2  # the prompt's full blocks once, then each beam's own tail
    assert peak_used <= shared < private


def test_beam_search_survives_preemption(llm):
    """A cache too small for everyone at once: beams and plain requests preempt each other and
    beam search still returns what it returns alone."""
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    alone = llm.beam_search(PROMPTS[:2], params)
    small = LLM(dtype="float32", device="cpu", num_kv_blocks=6)  # 6 beams of 2 blocks each: 12
    outs = small.beam_search(PROMPTS[:2], params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, outs):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
])
def test_bad_beam_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_beam_width_above_limit_refused(llm):
    limit = llm.llm_engine.config.scheduler.max_num_seqs
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=limit + 1, max_tokens=4))
    assert llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences  # still serving
