"""Executors run the model runner(s) of one engine core: in process (uni), one spawned worker
process per rank (mp), or one Ray actor per rank, on any node of a Ray cluster (ray).

Every executor has the same small interface, used by engine/llm_engine.py:
    num_blocks        KV blocks of every rank (the smallest number any rank's budget holds)
    launch(sched)     send one plain SchedulerOutput to every rank; returns a handle at once
    finish(handle)    the RunnerOutput of that step, from the driver rank (the last pipeline
                      stage's first tensor-parallel rank); handles are finished in launch order
    check_health()    raises ExecutorDeadError if a rank died
    shutdown()        stops every rank; no process is left behind
A rank that dies or raises makes launch/finish/check_health raise ExecutorDeadError: the engine
then fails every request (finish_reason "error") and reports itself dead.
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.executor.errors import ExecutorDeadError

__all__ = ["ExecutorDeadError", "make_executor"]


def make_executor(config: EngineConfig, model=None):
    """model: an already loaded CausalLM of the same model config to reuse (uni only; see LLMEngine)."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        from minivllm.executor.uniproc import UniProcExecutor
        return UniProcExecutor(config, model)
    if model is not None:
        raise ValueError("a loaded model can only be reused in process (distributed_executor_backend='uni')")
    if backend == "mp":
        from minivllm.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(config)
    from minivllm.executor.ray_executor import RayExecutor
    return RayExecutor(config)
