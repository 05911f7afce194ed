"""Data parallelism: data_parallel_size engine replicas behind one engine interface.

Each replica is a whole LLMEngine (its scheduler, KV cache and executor: tp x pp ranks of its
own; on CUDA its GPUs follow its data_parallel_rank). `DataParallelEngine` has LLMEngine's
interface, so `LLM` and the server's engine core drive it unchanged:

    add_request   routed once, to the replica holding the longest resident prefix of the prompt
                  (prefix-cache aware), else the least loaded (waiting + running, then KV use)
    step          every replica with work steps; outputs are merged
    get_stats     the sum, with each replica's own stats in `replicas` (metrics per replica)
    history       one merged StepRecord per round of replica steps (the dashboard, /load,
                  timelines): counts summed over the replicas, the batches and block maps joined
    profiler      one EngineProfiler for every replica (they step on this thread), which also
                  traces every replica's worker ranks (mp executor)

Replicas step one after another in this process: with the mp executor (the default for
data_parallel_size > 1) each replica's model runs in its own worker process. With expert
parallelism across the replicas (enable_expert_parallel) they share one world and step in
lock-step instead, each in its own thread (engine/dp_lockstep.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

from concurrent.futures import ThreadPoolExecutor

from minivllm.config import EngineConfig
from minivllm.engine.dp_lockstep import start_replicas, step_replicas
from minivllm.engine.input_processor import PromptInput, parse_prompt
from minivllm.engine.llm_engine import EngineStats, LLMEngine
from minivllm.engine.profiler import EngineProfiler
from minivllm.engine.step_history import (MAX_MAP_CELLS, StepHistory, merge_block_maps, merge_records, state_record,
                                          take_block_map)
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class DataParallelEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.replicas: list[LLMEngine] = []
        # expert parallelism across the replicas: one world, started and stepped in lock-step
        # (engine/dp_lockstep.py), one thread per replica
        self._lockstep = (ThreadPoolExecutor(config.parallel.data_parallel_size, thread_name_prefix="minivllm-dp")
                          if config.parallel.spans_replicas else None)
        self.num_idle_steps = 0  # lock-step: forwards run by a replica with nothing of its own
        try:
            if self._lockstep is not None:
                self.replicas = start_replicas(config, self._lockstep)
            for r in range(config.parallel.data_parallel_size if self._lockstep is None else 0):
                parallel = dataclasses.replace(config.parallel, data_parallel_rank=r)
                self.replicas.append(LLMEngine(dataclasses.replace(config, parallel=parallel)))
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = self.replicas[0].tokenizer
        self.history = StepHistory()  # merged: see _record_round
        self.profiler = EngineProfiler()
        for i, e in enumerate(self.replicas):
            e.profiler = self.profiler  # phases of every replica are labelled while a trace runs
            self.profiler.add_ranks(e.executor, f"dp{i}-")
        self._owner: dict[str, LLMEngine] = {}  # request id -> its replica
        self._ids = itertools.count()
        self.last_step: dict[str, float] = {}
        self.startup_s = time.perf_counter() - t0
        logger.info("data parallel: %d replicas ready in %.1f s", len(self.replicas), self.startup_s)

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def dead_error(self) -> BaseException | None:
        return next((e.dead_error for e in self.replicas if e.dead_error is not None), None)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request=None) -> None:
        """LLMEngine.add_request's signature (AsyncEngine and the engine core pass every argument)."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = self.route(prompt)
        replica.add_request(request_id, prompt, params, arrival_time, priority, lora_request)
        self._owner[request_id] = replica

    def route(self, prompt: PromptInput) -> LLMEngine:
        """The replica for a new prompt: most resident prefix blocks first, then the fewest
        waiting + running requests, then the lowest KV use."""
        try:
            parsed = parse_prompt(prompt, self.tokenizer)
        except Exception:  # noqa: BLE001 - the replica's add_request reports a bad prompt
            return self.replicas[0]

        def key(e: LLMEngine):
            hit = e.block_manager.cached_prefix_blocks(parsed.token_ids, parsed.cache_salt)
            return -hit, e.scheduler.num_waiting + e.scheduler.num_running, e.block_manager.usage
        return min(self.replicas, key=key)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            owner = self._owner.get(rid)
            if owner is not None:
                owner.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(e.get_num_unfinished_requests() for e in self.replicas)

    def unfinished_request_ids(self) -> list[str]:
        return [rid for e in self.replicas for rid in e.unfinished_request_ids()]

    # ---- steps ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self.last_step = {}
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        first = [e.history.next_step for e in self.replicas]
        if self._lockstep is not None:
            for out, idle in step_replicas(self.replicas, self._lockstep):
                outputs += out
                self.num_idle_steps += idle
        else:
            for e in busy:
                outputs += e.step()
        for e in busy:
            for k, v in e.last_step.items():
                self.last_step[k] = self.last_step.get(k, 0) + v
        recorded = [e.history.next_step > n for e, n in zip(self.replicas, first)]  # replicas that stepped
        if any(recorded):
            self._record_round(recorded)
        for o in outputs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outputs

    def _record_round(self, recorded: list[bool]) -> None:
        """One merged record for this round: a replica that stepped contributes its new record
        (its state when it scheduled), an idle one its state now with no tokens; the batches
        of the replicas that stepped are joined, and the block maps when one is due."""
        now = time.time()
        records = [e.history.latest() if stepped else
                   state_record(0, now, e.scheduler, e.block_manager, e.generation_tokens_total)
                   for e, stepped in zip(self.replicas, recorded)]
        t = min(r.t for r, stepped in zip(records, recorded) if stepped)
        batch = [s for e, stepped in zip(self.replicas, recorded) if stepped for s in e.history.latest_batch()]
        block_map = None
        if self.history.block_map_due(now):
            cells = MAX_MAP_CELLS // len(self.replicas)
            block_map = merge_block_maps([take_block_map(e.block_manager, now, cells) for e in self.replicas], now)
        self.history.add([merge_records(self.history.next_step, t, records)], batch, block_map)

    def check_health(self) -> None:
        for e in self.replicas:
            e.check_health()

    def get_stats(self) -> EngineStats:
        each = [e.get_stats() for e in self.replicas]
        total = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)
                 if f.type in ("int", int)}
        used = sum(s.num_kv_blocks - s.num_free_blocks for s in each)
        counts = [s.expert_token_counts for s in each if s.expert_token_counts is not None]
        return EngineStats(**total, kv_cache_usage=used / max(1, total["num_kv_blocks"]),
                           spec_accepted_per_pos=(), expert_token_counts=_sum_columns(counts),
                           replicas=tuple(each))

    def expert_token_counts_per_layer(self) -> list[list[int]] | None:
        """[MoE layers][experts] over every replica (each counts its own tokens once), read now."""
        each = [e.executor.expert_token_counts_per_layer() for e in self.replicas]
        each = [c for c in each if c is not None]
        return [list(_sum_columns(layer)) for layer in zip(*each)] if each else None

    def reset_prefix_cache(self) -> bool:
        return all([e.reset_prefix_cache() for e in self.replicas])

    def release_held_kv(self) -> None:
        for e in self.replicas:
            e.release_held_kv()

    def shutdown(self) -> None:
        for e in self.replicas:
            e.shutdown()
        if self._lockstep is not None:
            self._lockstep.shutdown(wait=False)


def _sum_columns(rows) -> tuple[int, ...] | None:
    """Element-wise sum of equal-length count vectors (None: no vectors)."""
    rows = list(rows)
    return tuple(sum(col) for col in zip(*rows)) if rows else None
