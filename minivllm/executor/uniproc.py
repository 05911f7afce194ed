"""The in-process executor: one runner in the engine's own process (world size 1)."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.core.interfaces import RunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig, model=None) -> None:
        from minivllm.runner.model_runner import ModelRunner
        self.runner = ModelRunner(config)
        self.runner.load_model(model)
        self.num_blocks = self.runner.init_kv_cache()
        self.runner.capture_cuda_graphs()
        self.runner.warm_up_kernels()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def launch(self, sched: SchedulerOutput):
        """Queue a step without waiting (async scheduling); pass the result to finish()."""
        return self.runner.launch(sched)

    def finish(self, launched) -> RunnerOutput:
        return self.runner.finish(launched)

    def check_health(self) -> None:
        pass  # the runner lives and dies with this process

    def shutdown(self) -> None:
        pass
