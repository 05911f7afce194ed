"""Bad input raises a clear ValueError naming the field and the limit; the engine keeps serving."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams


def _still_serves(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n"),
    ({"min_p": 2.0}, "min_p"),
    ({"logprobs": 100}, "logprobs"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    _still_serves(llm)


def test_prompt_over_max_model_len(llm):
    limit = llm.llm_engine.max_model_len
    with pytest.raises(ValueError, match=f"max_model_len.*{limit}"):
        llm.generate([[1] * (limit + 5)], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1] * 100], SamplingParams(max_tokens=limit), use_tqdm=False)
    _still_serves(llm)


def test_bad_request_in_batch_refuses_batch_keeps_engine(llm):
    with pytest.raises(ValueError):
        llm.generate(["Hello", [10**9]], use_tqdm=False)  # token id out of the vocabulary
    assert not llm.llm_engine.has_unfinished_requests()
    _still_serves(llm)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not a local file or directory"):
        LLM(model="/nonexistent/model-dir")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\x01garbage" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        LLM(model=str(bad))


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("abort-me", "Tell me a long story about dragons.", SamplingParams(max_tokens=200))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request("abort-me")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "abort-me"] == ["abort"]
    assert not engine.has_unfinished_requests()
