"""Structured outputs on the GPU: the whole path with async scheduling, CUDA graphs and the
Triton bitmask kernel, on Qwen3-0.6B shapes with dummy weights and the SmolLM2 tokenizer that W7
uses (bench/w7.py): every output that ends with "stop" validates / matches; regex, choice, n > 1.
Random weights make the text random, so only the constraint is checked.

Run on the GPU machine after `bash scripts/xgrammar_stage.sh` (PYTHONPATH=/tmp/xgr-site:.)."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def llm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from minivllm import LLM
    from minivllm.bench import w7
    model_dir = w7.write_model_dir(base="qwen3-0.6b")
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=2048, seed=0,
              gpu_memory_utilization=0.5)
    assert llm.llm_engine.async_scheduling
    return llm


def test_schemas_validate_on_gpu(llm):
    from minivllm import SamplingParams, StructuredOutputsParams
    from minivllm.bench import w7
    schemas = w7.load_schemas()
    prompts = w7.w7_requests()[0]
    reqs = [(prompts[i], schemas[i % 8][2], i) for i in range(32)]
    sps = [SamplingParams(temperature=0.6, seed=i, max_tokens=256, structured_outputs=StructuredOutputsParams(json=s))
           for _, s, i in reqs]
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in reqs], sps, use_tqdm=False)
    stopped = [(o.outputs[0].text, s) for o, (_, s, _) in zip(outs, reqs) if o.outputs[0].finish_reason == "stop"]
    assert stopped, "no request finished its JSON within 256 tokens"
    bad = [t for t, s in stopped if not w7.validates(t, s)]
    assert not bad, bad[:3]
    for o in outs:
        assert o.outputs[0].finish_reason in ("stop", "length") and o.outputs[0].text.lstrip().startswith(("{", "["))


def test_regex_choice_and_n_on_gpu(llm):
    from minivllm import SamplingParams, StructuredOutputsParams
    regex, choices = r"[0-9]{3}-[a-z]{2,5}", ["alpha", "beta", "gamma delta"]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=regex))
              for s in range(8)]
    params += [SamplingParams(temperature=1.0, seed=9, max_tokens=8, n=4,
                              structured_outputs=StructuredOutputsParams(choice=choices))]
    params += [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)]  # unconstrained beside them
    outs = llm.generate([[1, 2, 3, 4, 5 + i] for i in range(len(params))], params, use_tqdm=False)
    for o in outs[:8]:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    assert len(outs[8].outputs) == 4 and all(c.text in choices for c in outs[8].outputs)
    assert len(outs[9].outputs[0].token_ids) == 32


def test_logprobs_respect_the_mask_on_gpu(llm):
    from minivllm import SamplingParams, StructuredOutputsParams
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    o = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0]
    finite = [t for t, lp in o.logprobs[0].items() if lp.logprob > float("-inf")]
    assert o.text in ("yes", "no") and finite
    assert all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in finite)


def _pipeline_run(model_dir: str, pipeline: str, reqs, params, monkeypatch):
    """Token ids of one generate call on a fresh batch-invariant engine with
    MINIVLLM_GRAMMAR_PIPELINE=pipeline, and how many of its steps took the pipelined path."""
    from minivllm import LLM
    monkeypatch.setenv("MINIVLLM_GRAMMAR_PIPELINE", pipeline)
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=2048, seed=0,
              kv_cache_memory_bytes=2 << 30, batch_invariant=True)  # beside the module engine: an explicit budget
    got = [o.outputs[0].token_ids for o in llm.generate(reqs, params, use_tqdm=False)]
    pipelined = llm.llm_engine.num_pipelined_steps
    llm.llm_engine.shutdown()
    return got, pipelined


def test_pipelined_constrained_steps_equal_the_unpipelined_ones(llm, monkeypatch):
    """The constrained step that queues the next step's forward behind its sampling
    (LLMEngine._pipeline_next, on by default with async scheduling) gives the same tokens as an
    engine with it off (MINIVLLM_GRAMMAR_PIPELINE=0), seeded sampling, constrained and free rows
    mixed, CUDA graphs on. Both engines are fresh and batch-invariant: the pipelining may change
    which rows share a step (a finished row rides one step longer), and in the default mode a
    bf16 row's logits then differ in the last bits, enough to flip a sampled token (lease 13:
    the module engine, whose prefix cache also held these prompts, differed from a fresh one)."""
    from minivllm import SamplingParams, StructuredOutputsParams
    from minivllm.bench import w7
    schemas = w7.load_schemas()
    prompts = w7.w7_requests()[0][:24]
    params = [SamplingParams(temperature=0.6, seed=i, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=schemas[i % 8][2]) if i % 3 else None)
              for i in range(len(prompts))]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    model_dir = llm.llm_engine.config.model.model
    got, pipelined = _pipeline_run(model_dir, "1", reqs, params, monkeypatch)
    want, plain_pipelined = _pipeline_run(model_dir, "0", reqs, params, monkeypatch)
    assert pipelined > 0 and plain_pipelined == 0
    assert got == want
