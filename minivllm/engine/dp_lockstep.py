"""Data-parallel replicas in lock-step: expert parallelism across replicas (enable_expert_parallel,
data_parallel_size > 1).

Every replica's worker ranks are in one torch.distributed world (distributed/parallel_state.py),
and each MoE layer's all_to_all needs every rank of every replica. So:

    startup   the replicas start together (one thread each): a replica's ranks wait in
              init_process_group, and in any forward of the startup, for the other replicas'
    a step    once any replica has work, every replica runs exactly one forward, all at once
              (one thread each: a replica's step waits on its ranks, which wait on the others):
              its own step, or, if that launched nothing (no requests, or nothing schedulable),
              an idle one (runner: no tokens, only the all_to_alls: model.idle_step)
    failure   a replica whose executor died leaves the others' ranks waiting in a collective:
              their workers are killed, so every replica's step ends (ExecutorDeadError)

Async scheduling is off for such replicas (config_builder): one LLMEngine.step launches at most
one forward and finishes it before returning.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.errors import ExecutorDeadError
from minivllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting step checks whether a replica died


def start_replicas(config: EngineConfig, pool: ThreadPoolExecutor) -> list[LLMEngine]:
    """Every replica's LLMEngine, built at the same time, their ranks meeting on one free port."""
    from minivllm.executor.multiproc import free_port
    port = free_port()
    configs = [dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, data_parallel_rank=r, data_parallel_master_port=port))
        for r in range(config.parallel.data_parallel_size)]
    futures = [pool.submit(LLMEngine, c) for c in configs]
    wait(futures, return_when=FIRST_EXCEPTION)
    if any(f.done() and f.exception() is not None for f in futures):
        # a replica failed: the others' ranks may wait for its ranks forever (rendezvous)
        for f in futures:
            if f.done() and f.exception() is None:
                f.result().shutdown()
        raise next(f.exception() for f in futures if f.done() and f.exception() is not None)
    return [f.result() for f in futures]


def step_replicas(replicas: list[LLMEngine], pool: ThreadPoolExecutor) -> list[tuple[list[RequestOutput], bool]]:
    """One lock-step step (see the module docstring): each replica's (outputs, whether its
    forward was an idle one)."""
    if not any(e.has_unfinished_requests() for e in replicas):
        return [([], False) for _ in replicas]
    futures = [pool.submit(_step_one, e) for e in replicas]
    while True:
        done, pending = wait(futures, timeout=POLL_S)
        if not pending:
            break
        if any(e.dead_error is not None for e in replicas):
            for e in replicas:  # their ranks may be blocked in an all_to_all with the dead one's
                if e.dead_error is None:
                    e.executor.kill_workers()
    return [f.result() for f in futures]


def _step_one(engine: LLMEngine) -> tuple[list[RequestOutput], bool]:
    """The replica's step; an idle forward if it launched none (every rank one forward per step)."""
    if engine.dead_error is not None:
        return (engine.step() if engine.has_unfinished_requests() else []), False
    before = engine.executor.num_launched
    outputs = engine.step() if engine.has_unfinished_requests() else []
    if engine.executor.num_launched != before or engine.dead_error is not None:
        return outputs, False
    try:
        engine.executor.run_idle_step()
    except ExecutorDeadError as e:  # a rank died: this replica is dead, as its own step would find
        outputs += engine._die(e)
    return outputs, True
