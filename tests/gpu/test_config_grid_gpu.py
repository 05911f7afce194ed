"""Issue 17's differential grid on the GPU paths (CUDA graphs with async scheduling, eager, graphs
without async scheduling), float32 on the real SmolLM2 weights: every request ends with stop or
length, no block leaks, and tokens equal the unconstrained configuration's."""

from __future__ import annotations

import pytest

from minivllm.bench.config_grid import GPU_PATHS, GridRunner, grid_requests, quick_grid

pytestmark = pytest.mark.gpu
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def grid():
    from minivllm.engine.config_builder import build_engine_config
    from minivllm.engine.tokenizer import load_tokenizer
    points = [p for path in GPU_PATHS for p in quick_grid(path, MAX_MODEL_LEN)]
    cfg = build_engine_config(device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN)
    requests = grid_requests(load_tokenizer(cfg.model), MAX_MODEL_LEN, {p.block_size for p in points},
                             {p.max_num_batched_tokens for p in points})
    return GridRunner(requests, MAX_MODEL_LEN, device="cuda", dtype="float32"), points


@pytest.mark.parametrize("index", range(len(GPU_PATHS) * len(quick_grid("graphs", MAX_MODEL_LEN))))
def test_gpu_tokens_equal_the_unconstrained_configuration(grid, index):
    runner, points = grid
    r = runner.check(points[index])
    assert not r.bad_finishes, r.bad_finishes
    assert r.leaked_blocks == 0
    assert not r.mismatches, "\n".join(r.mismatches)
