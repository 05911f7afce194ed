"""Issue 20 on one GPU: the mp executor (a worker process owning the GPU, CUDA graphs and async
scheduling inside it, two steps in flight) gives the in-process engine's greedy tokens, and so
does the in-process engine with two steps in flight; more ranks than GPUs is a clear error at
startup."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
KW = dict(device="cuda", dtype="float32", max_model_len=512, kv_cache_memory_bytes=1 << 30)


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("reply_thread", ["0", "1"])  # the driver's Replier off (default) and on
def test_one_worker_process_equals_in_process(monkeypatch, reply_thread):
    monkeypatch.setenv("MINIVLLM_DRIVER_REPLY_THREAD", reply_thread)  # the worker process inherits it
    llm = LLM(**KW)
    want = _tokens(llm)
    llm.llm_engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    llm = LLM(distributed_executor_backend="mp", **KW)
    try:
        assert llm.llm_engine.config.async_scheduling
        assert _tokens(llm) == want
        assert llm.llm_engine.num_steps_ahead > 0  # (engine/llm_engine.steps_ahead)
    finally:
        llm.llm_engine.shutdown()


def test_two_steps_in_flight_in_process_equal_one(monkeypatch):
    """The in-process engine in CUDA graphs with MINIVLLM_STEPS_AHEAD=2: the placeholders of a
    step read tokens two launches old on the device."""
    llm = LLM(**KW)
    want = _tokens(llm)
    llm.llm_engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    monkeypatch.setenv("MINIVLLM_STEPS_AHEAD", "2")
    llm = LLM(**KW)
    try:
        assert _tokens(llm) == want
        assert llm.llm_engine.num_steps_ahead > 0
    finally:
        llm.llm_engine.shutdown()


def test_more_ranks_than_gpus_is_refused():
    from minivllm.engine.config_builder import build_engine_config
    if torch.cuda.device_count() >= 3:
        pytest.skip("this machine has 3 GPUs or more")
    with pytest.raises(ValueError, match=r"= 3 ranks, more than the \d GPU\(s\) of this machine"):
        build_engine_config(tensor_parallel_size=3, **KW)
