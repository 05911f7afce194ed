"""Issue 17 and its class of bug: a request's tokens must not depend on how the engine cuts the
work into steps (minivllm/bench/config_grid.py). CI runs a slice of the grid on every CPU model
path; `minivllm bench config-grid` runs the whole grid (and `--device cuda` the GPU paths)."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.bench.config_grid import CPU_PATHS, GridRunner, grid_requests, quick_grid

MAX_MODEL_LEN = 128
# the slice: every point on the compiled-kernel path; on the slower PyTorch-op and module paths
# (a 1-token budget takes them minutes) the shared-prefix and the preempting points
POINTS = [p for path in CPU_PATHS for p in quick_grid(path, MAX_MODEL_LEN)[slice(None) if path == "kernels" else slice(1, 3)]]


@pytest.fixture(scope="module")
def grid(llm):
    block_sizes = {p.block_size for p in POINTS}
    budgets = {p.max_num_batched_tokens for p in POINTS}
    requests = grid_requests(llm.get_tokenizer(), MAX_MODEL_LEN, block_sizes, budgets)
    return GridRunner(requests, MAX_MODEL_LEN, device="cpu", dtype="float32"), []


def test_grid_prompts_cover_the_boundaries(grid):
    runner, _ = grid
    lengths = {len(r.prompt_token_ids) for r in runner.requests}
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, MAX_MODEL_LEN - 1):
        assert n in lengths, f"no prompt of {n} tokens"
    assert any(r.params.n > 1 and not r.params.greedy for r in runner.requests)


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.label.replace(" ", "_"))
def test_tokens_equal_the_unconstrained_configuration(grid, point):
    runner, results = grid
    r = runner.check(point)
    results.append(r)
    assert not r.bad_finishes, r.bad_finishes
    assert not r.mismatches, "\n".join(r.mismatches)
    assert r.leaked_blocks == 0


def test_the_slice_exercised_preemption_and_prefix_hits(grid):
    _, results = grid
    assert len(results) == len(POINTS), "run with the parametrized grid tests"
    assert any(r.num_preemptions > 0 for r in results if r.point.tiny_kv)
    assert all(r.prefix_hit_tokens > 0 for r in results if r.point.enable_prefix_caching)


def test_prompt_longer_than_the_step_budget_answers(llm):
    """Issue 17's report: on the default configuration (a 2,048-token budget) a longer prompt
    used to end with finish_reason 'error' (a step of prompt chunks that sample nothing)."""
    budget = llm.llm_engine.config.scheduler.max_num_batched_tokens
    prompt = "The quick brown fox jumps over the lazy dog. " * 240
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > budget
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8


def test_prompt_longer_than_the_step_budget_answers_through_the_server():
    """The same through `minivllm serve`'s default engine (the engine core in its own process, the
    default configuration) and the official client."""
    import openai

    from minivllm.engine.mp_async_engine import MPAsyncEngine
    from minivllm.server.app import create_app
    from minivllm.server.serving_common import ServerSettings
    from minivllm.server.testing import ServerThread
    engine = MPAsyncEngine.from_kwargs(dtype="float32", device="cpu")
    server = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.completions.create(model=engine.config.model.served_name, max_tokens=8, temperature=0,
                                      prompt="The quick brown fox jumps over the lazy dog. " * 240)
        assert r.usage.prompt_tokens > engine.config.scheduler.max_num_batched_tokens
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    finally:
        server.stop()
        engine.shutdown()
