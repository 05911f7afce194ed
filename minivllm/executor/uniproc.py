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
        self.host_kv = self.runner.init_kv_transfer()  # swap space and KV offload tier, in blocks
        self.kv_connector = self.runner.init_kv_connector()  # disaggregated prefill/decode (None: off)
        self.runner.capture_cuda_graphs()
        self.runner.warm_up_kernels()
        self.runner.expert_counts.reset()  # count requests' tokens only, not the startup passes

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def launch(self, sched: SchedulerOutput):
        """Queue a step without waiting (async scheduling); pass the result to finish()."""
        return self.runner.launch(sched)

    def launch_forward(self, sched: SchedulerOutput, inputs=None):
        """Queue a step's forward only; launch_sampling() then samples it (with a grammar bitmask).
        inputs: prepare_forward's, built earlier on the host."""
        return self.runner.launch_forward(sched, inputs)

    def prepare_forward(self, sched: SchedulerOutput):
        """A step's inputs built on the host ahead of its launch (in-process runners only)."""
        return self.runner.prepare_forward(sched)

    def launch_sampling(self, forward, grammar=None):
        return self.runner.launch_sampling(forward, grammar)

    def finish(self, launched) -> RunnerOutput:
        return self.runner.finish(launched)

    def check_health(self) -> None:
        pass  # the runner lives and dies with this process

    def expert_token_counts(self) -> tuple[int, ...] | None:
        """A MoE model's tokens routed to each expert (summed over its layers), as of up to a
        second ago; None for a dense model."""
        return self.runner.expert_counts.latest

    def expert_token_counts_per_layer(self) -> list[list[int]] | None:
        """[MoE layers][experts] read now (waits for queued device work); None for a dense model."""
        return self.runner.expert_counts.per_layer()

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
