"""W2/W11's per-step record of a timed run (bench latency): each timed generate's engine steps
summed per host phase, and the steps where the device waited for the host, so that a slow run
tells whether the host or the device made it slow (issue 25: W11-awq's timed runs spread 5 %)."""

from __future__ import annotations

from minivllm.bench.procedures import GenResult, run_latency, step_phase_summary
from minivllm.bench.run_minivllm import MinivllmAdapter
from minivllm.bench.workloads import Workload


def test_step_phase_summary_counts_host_bound_steps() -> None:
    steps = [{"schedule": 1e-4, "launch": 2e-4, "wait": 2.5e-3, "update": 1e-4, "outputs": 5e-5, "wall": 3e-3},
             {"schedule": 1e-4, "launch": 2e-4, "wait": 1e-5, "update": 1e-4, "outputs": 5e-5, "wall": 4.5e-3},
             {"wall": 1e-3}]  # a step that scheduled nothing has no phases
    s = step_phase_summary(steps)
    assert s["steps"] == 3 and s["host_bound_steps"] == 2  # the second waited 10 us; the third not at all
    assert s["wall_ms"] == 8.5 and s["slowest_step_ms"] == 4.5
    assert s["wait_ms"] == 2.51 and s["schedule_ms"] == 0.2 and s["outputs_ms"] == 0.1


class _Engine:
    """An engine whose step reports host phases as LLMEngine does (last_step, fresh each step)."""

    def __init__(self) -> None:
        self.last_step: dict = {}
        self.calls = 0

    def step(self) -> list:
        self.calls += 1
        self.last_step = {"schedule": 1e-4, "wait": 0.0 if self.calls % 2 else 2e-3}
        return []


def test_record_steps_wraps_the_engine_step_and_restores_it() -> None:
    adapter = MinivllmAdapter.__new__(MinivllmAdapter)  # no model: only the engine is used
    adapter.engine_obj = engine = _Engine()
    with adapter.record_steps() as steps:
        for _ in range(3):
            engine.step()
    engine.step()  # outside: not recorded
    assert [s["wait"] for s in steps] == [0.0, 2e-3, 0.0] and all(s["wall"] >= 0 for s in steps)
    assert "step" not in vars(engine) and engine.calls == 4


class _Fake:
    """An adapter that 'generates' by stepping a fake engine once per output token."""

    engine, version = "fake", "0"

    def __init__(self, record: bool) -> None:
        self.eng = _Engine()
        if record:
            self.engine_obj = self.eng
            self.record_steps = MinivllmAdapter.record_steps.__get__(self)

    def prepare(self, params: list[dict]) -> list:
        return params

    def generate(self, prompts, prepared, want_ttft: bool = False) -> list[GenResult]:
        n = prepared[0]["max_tokens"]
        for _ in range(n):
            self.eng.step()
        return [GenResult(n, len(prompts[0]["prompt_token_ids"]), 0, None)]

    def reset_prefix_cache(self) -> bool:
        return True

    def prefix_counters(self):
        return None


def _w2(n: int) -> Workload:
    return Workload("W2", "tiny-llama", [[1, 2, 3]], [{"max_tokens": n, "temperature": 0.0, "ignore_eos": True}],
                    64, "test")


def test_latency_details_carry_each_timed_runs_steps() -> None:
    res = run_latency(_Fake(record=True), _w2(6), reps=3)
    runs = res["details"]["steps_max_tokens_6"]
    assert len(runs) == 3 and all(r["steps"] == 6 for r in runs), runs
    # the fake engine's wait alternates 0 and 2 ms over all its calls: 3 of each run's 6 steps host-bound
    assert [r["host_bound_steps"] for r in runs] == [3, 3, 3], runs
    assert "steps_max_tokens_6" not in run_latency(_Fake(record=False), _w2(6), reps=2)["details"]
