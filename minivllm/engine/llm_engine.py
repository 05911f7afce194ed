"""The synchronous engine: add requests, call step() until done. Used by LLM and the server."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass

from minivllm.config import EngineConfig
from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import RequestFault
from minivllm.core.offload_cache import OffloadCache
from minivllm.core.request import RequestStatus
from minivllm.core.scheduler import Scheduler, SchedulerLimits
from minivllm.core.swap_space import SwapSpace
from minivllm.engine.config_builder import build_engine_config
from minivllm.engine.errors import EngineDeadError
from minivllm.engine.gc_heap import freeze_startup_heap, unfreeze_heap
from minivllm.sample.batch import validate_for_vocab
from minivllm.engine.input_processor import (
    PromptInput,
    make_beam_request,
    make_pooling_request,
    make_sample_requests,
    parse_prompt,
    validate_pooling_prompt,
    validate_prompt,
)
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.profiler import EngineProfiler
from minivllm.engine.step_history import StepHistory
from minivllm.lora.checker import AdapterChecker
from minivllm.executor.errors import ExecutorDeadError
from minivllm.outputs import RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

SPEC_LOG_INTERVAL_S = 10.0  # how often the acceptance of speculative decoding is logged
# Python's GIL switch interval while a grammar fill runs beside the output processing (see _take_in)
FILL_SWITCH_INTERVAL_S = 0.0002
KV_IDLE_WAIT_S = 0.005  # an engine waiting only for KV transfers polls its connector this often


def steps_ahead(config: EngineConfig) -> int:
    """How many steps stay in flight when step() returns: 2 where the ranks run in worker
    processes of their own (the mp executor) with async scheduling, else 1.

    Why (issue 27, lease 58's traces of W1-8B at tp=2): with one step in flight, the engine core
    schedules step N + 2 only after N's output, and the ranks launch N + 2 only after that
    schedule arrives: the core's work (update, outputs, schedule, send: ~5 ms at batch 256) and
    the ranks' (receive, inputs, launch: ~4 ms) run one after the other, ~10 ms a step against
    an 8 ms device step. With two in flight, step N + 2 is sent before N's output is awaited, so
    the core's work for one step runs beside the ranks' work for the other, each in its own
    process; either alone fits in a device step. Measured on two H200s (lease 84, docs/perf.md),
    whose host was faster than lease 58's: +5 % at tp=2, within the runs' spread; neutral with one
    mp worker. The in-process engine does both on one thread, where running ahead gains nothing.
    MINIVLLM_STEPS_AHEAD=N sets it for any executor (1: off, to compare; 2 in process: the
    tests' way to run ahead without worker processes)."""
    p = config.parallel
    if (not config.async_scheduling or p.pipeline_parallel_size > 1 or p.spans_replicas
            or config.speculative is not None):
        return 1
    default = "2" if p.distributed_executor_backend == "mp" else "1"
    return max(1, int(os.environ.get("MINIVLLM_STEPS_AHEAD", default)))


@dataclass
class TakenIn:
    """What taking in a launched step gives (LLMEngine._take_in)."""

    outputs: list  # RequestOutputs ready now
    ok: bool  # the step succeeded
    bitmask: object = None  # the constrained step's mask filled beside the take-in (or None)
    # not None: beside_fill ran (next holds its result, possibly None) and the outputs of these
    # RequestUpdates are left to the caller, made after it has queued its sampling
    deferred: list | None = None
    next: tuple | None = None
    # beside_fill raised: the outputs were made all the same (they are the step before's), and
    # the caller fails the constrained step with this error, as if its own scheduling had raised
    error: BaseException | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_kv_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # computed prompt tokens, total
    generation_tokens: int  # generated tokens, total
    # speculative decoding (zeros without it): verify steps of a request, drafts verified,
    # drafts accepted, accepted drafts by position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    tokens_in_flight: int = 0  # prompt + max_tokens of every unfinished request (admission control)
    # MoE models: tokens routed to each expert, summed over the layers (refreshed about once a
    # second, runner/expert_counts.py); None for dense models
    expert_token_counts: tuple[int, ...] | None = None
    # KV in host memory (kv_transfer/): blocks swapped out and in (swap preemption), requests
    # swapped now, blocks loaded back from the prefix cache's offload tier (hits) and stored
    # there, and the bytes all those copies moved
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_swapped: int = 0
    offload_hit_blocks: int = 0
    offload_stored_blocks: int = 0
    kv_transfer_bytes: int = 0
    # disaggregated prefill/decode: blocks pulled from prefill instances, pulls given up (the
    # prompt recomputed here), finished requests whose blocks wait for a decode instance
    kv_pulled_blocks: int = 0
    kv_pull_failures: int = 0
    kv_held_requests: int = 0
    # data parallelism (engine/dp_engine.py): each replica's own stats; the fields above are their sum
    replicas: tuple[EngineStats, ...] = ()


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None) -> None:
        """model: reuse this already loaded CausalLM (built for the same model, dtype and
        device) instead of loading the weights again; the engine that loaded it must not run
        any more (the KV cache it reads is replaced). Tests and the configuration grid use it."""
        t0 = time.perf_counter()
        self.config = config
        self.tokenizer = None
        if not config.model.skip_tokenizer_init:
            from minivllm.engine.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(config.model)
        from minivllm.executor import make_executor
        self.executor = make_executor(config, model)
        self.dead_error: BaseException | None = None  # a rank died: every request failed, none is taken
        from minivllm.engine.faults import FaultInjection
        faults = FaultInjection.from_env()  # the soak suite's, off unless MINIVLLM_FAULT_INJECTION is set
        if faults is not None:
            faults.install(self.executor)
        num_blocks = self.executor.num_blocks
        # host KV tiers (kv_transfer/): the in-process executor's; none with several ranks (refused in config)
        self.host_kv = getattr(self.executor, "host_kv", None)
        host = self.host_kv
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          config.cache.prefix_caching_hash_algo,
                                          OffloadCache(host.num_offload_blocks) if host and host.num_offload_blocks
                                          else None)
        swap = SwapSpace(host.num_swap_blocks, config.cache.preemption_mode, host.swap_costs) \
            if host and host.num_swap_blocks else None
        s, spec = config.scheduler, config.speculative
        self.scheduler = Scheduler(SchedulerLimits(s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len,
                                                   s.policy, s.enable_chunked_prefill,
                                                   s.max_prefill_tokens_with_decodes,
                                                   spec.num_lookahead_tokens if spec else 0,
                                                   spec.disable_by_batch_size if spec else None,
                                                   config.parallel.pipeline_parallel_size,
                                                   max_loras=config.lora.max_loras if config.lora else None),
                                   self.block_manager, swap)
        # disaggregated prefill/decode (kv_transfer/connector.py): the in-process runner's connector
        self.kv_connector = getattr(self.executor, "kv_connector", None)
        if self.kv_connector is not None:
            self.scheduler.kv_address = self.kv_connector.address
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self.adapters = AdapterChecker(config.lora, config.model.arch, config.model.served_name)
        self.structured = StructuredOutputManager(config.structured_outputs, self.tokenizer, config.model.arch.vocab_size,
                                                  self.eos_token_ids, s.max_num_seqs,
                                                  pin_memory=config.device.startswith("cuda"))
        self._aborted_outputs: list[RequestOutput] = []
        # async scheduling: the next step is scheduled and launched while this one runs
        self.async_scheduling = config.async_scheduling
        self._inflight = None  # (SchedulerOutput, launched step) still running on the device
        # with the mp executor, also the plain steps launched before it, oldest first (steps_ahead)
        self._older: deque = deque()
        # (KV transfers are handed over between steps, with no step's results unseen)
        self._steps_ahead = steps_ahead(config) if self.kv_connector is None else 1
        self.num_steps_ahead = 0  # steps kept in flight behind a newer one (tests, profiling)
        # a constrained step's next step, scheduled (and its forward queued) before the constrained
        # step's sampling, see _pipeline_next: (SchedulerOutput, queued forward or None, its
        # schedule record) for the next step() to take up
        self._next = None
        self.num_pipelined_steps = 0  # forwards queued that way (tests, profiling)
        self.num_early_schedules = 0  # steps scheduled beside the fill, outputs deferred (_take_in)
        # pipeline parallelism: up to one whole batch per stage in flight, oldest first
        self._max_batches = config.parallel.pipeline_parallel_size
        # (MINIVLLM_GRAMMAR_PIPELINE=0: off, to compare)
        self._can_pipeline = (self.async_scheduling and self._max_batches == 1 and config.speculative is None
                              and self.kv_connector is None and hasattr(self.executor, "prepare_forward")
                              and os.environ.get("MINIVLLM_GRAMMAR_PIPELINE", "1") != "0")
        self._batches: deque = deque()
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # host seconds of the last step's phases (schedule, launch, wait = blocked on the device,
        # update, outputs) and its size; cheap, always on (read by the probes and the step log)
        self.last_step: dict[str, float] = {}
        # per-step statistics (batch composition, queue, KV use) for the dashboard, /load, timelines
        self.history = StepHistory()
        # MINIVLLM_STEP_HISTORY=0: record no steps (only to measure what recording costs, e.g. on W1)
        self._record_steps = os.environ.get("MINIVLLM_STEP_HISTORY", "1") != "0"
        self.profiler = EngineProfiler()  # torch-profiler traces on demand (/start_profile, --profile)
        self.profiler.add_ranks(self.executor)  # worker processes trace themselves too
        self._spec_logged = (time.monotonic(), (0, 0, 0))  # when, and the counters then
        freeze_startup_heap()  # later full GC passes skip the model, the KV blocks, the imports
        self.startup_s = time.perf_counter() - t0
        logger.info("engine ready in %.1f s: %d KV blocks x %d = %d tokens", self.startup_s, num_blocks,
                    config.cache.block_size, num_blocks * config.cache.block_size)

    @classmethod
    def from_kwargs(cls, **kwargs) -> LLMEngine:
        """An engine, or data_parallel_size > 1 replicas behind the same interface."""
        return make_engine(build_engine_config(**kwargs))

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.config.model.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput,
                    params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request=None) -> None:
        """Validate and queue a request; raises ValueError (naming the field and limit) if it can't run.
        params: sampling (generate), BeamSearchParams (beam search) or PoolingParams (an embedding);
        lora_request: the LoRARequest the request runs with (enable_lora)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        params = params or SamplingParams()
        params.validate()
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        parsed = parse_prompt(prompt, self.tokenizer)
        remote = self._kv_transfer_params(params)
        self.adapters.check(lora_request)
        keys = dict(lora_request=lora_request, cache_salt=parsed.cache_salt)
        if isinstance(params, PoolingParams):
            reqs = [self._pooling_request(request_id, parsed.token_ids, params, priority, arrival_time, keys)]
        elif isinstance(params, BeamSearchParams):
            reqs = [self._beam_request(request_id, parsed.token_ids, params, priority, arrival_time, keys)]
        else:
            reqs = self._sample_requests(request_id, parsed, params, priority, arrival_time, keys)
            if remote is not None:
                reqs[0].remote_decode, reqs[0].remote_prefill = remote
        self.output_processor.add_request(request_id, parsed.text, parsed.token_ids, params,
                                          [r.request_id for r in reqs], reqs[0].arrival_time)
        for r in reqs:
            self.scheduler.add_request(r)

    def _kv_transfer_params(self, params):
        """(remote_decode, RemotePrefill or None) of a request's kv_transfer_params, checked
        against this engine's kv_role; None without them."""
        from minivllm.kv_transfer.params import of_sampling_params, parse
        raw = of_sampling_params(params) if isinstance(params, SamplingParams) else None
        if raw is None:
            return None
        decode, prefill = parse(raw)
        kv = self.config.kv_transfer
        if decode and (kv is None or not kv.is_producer):
            raise ValueError("kv_transfer_params.do_remote_decode needs an engine started with kv_transfer_config "
                             "kv_role 'kv_producer' or 'kv_both'")
        if prefill is not None and (kv is None or not kv.is_consumer):
            raise ValueError("kv_transfer_params.do_remote_prefill needs an engine started with kv_transfer_config "
                             "kv_role 'kv_consumer' or 'kv_both'")
        if (decode or prefill is not None) and params.n != 1:
            raise ValueError(f"kv_transfer_params needs n == 1 (one sequence per prompt), got n={params.n}")
        return decode, prefill

    def _sample_requests(self, request_id, parsed, params: SamplingParams, priority, arrival_time, keys):
        validate_for_vocab(params, self.config.model.arch.vocab_size)
        max_tokens = validate_prompt(parsed.token_ids, params, self.config.model.arch.vocab_size,
                                     self.max_model_len, self._cache_tokens)
        so = params.structured_outputs
        if so is not None:
            self.structured.validate(params)
        reqs = make_sample_requests(request_id, parsed.token_ids, params, max_tokens, self.eos_token_ids,
                                    priority, arrival_time, **keys)
        if so is not None:  # one matcher per sample; the compile starts now, off the step loop
            for r in reqs:
                r.grammar = self.structured.new_handle(r.request_id, so, parsed.token_ids)
        return reqs

    @property
    def _cache_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.cache.block_size

    def _pooling_request(self, request_id, tokens, params: PoolingParams, priority, arrival_time, lora):
        arch = self.config.model.arch
        validate_pooling_prompt(tokens, arch.vocab_size, self.max_model_len, self._cache_tokens)
        return make_pooling_request(request_id, tokens, params.resolved(self.config.pooler, arch.hidden_size),
                                    self.eos_token_ids, priority, arrival_time, **lora)

    def _beam_request(self, request_id, tokens, params: BeamSearchParams, priority, arrival_time, lora):
        """Beam search: checks the beam width against the engine (every beam is a sequence, and may
        hold its own copy of the tail of the prompt and its output)."""
        if self.config.speculative is not None:
            raise ValueError("beam search cannot run with speculative decoding: start an engine without "
                             "speculative_config")
        if self.config.parallel.pipeline_parallel_size > 1:
            raise ValueError("beam search is not supported with pipeline parallelism yet "
                             f"(pipeline_parallel_size={self.config.parallel.pipeline_parallel_size})")
        s, bs = self.config.scheduler, self.config.cache.block_size
        if params.beam_width > s.max_num_seqs:
            raise ValueError(f"BeamSearchParams.beam_width must be <= max_num_seqs={s.max_num_seqs} (every beam is "
                             f"a sequence), got {params.beam_width}")
        if 2 * params.beam_width > self.config.model.arch.vocab_size:
            raise ValueError(f"BeamSearchParams.beam_width must be <= half the vocabulary, got {params.beam_width}")
        max_tokens = validate_prompt(tokens, SamplingParams(max_tokens=params.max_tokens),
                                     self.config.model.arch.vocab_size, self.max_model_len, self._cache_tokens)
        need = len(tokens) // bs + params.beam_width * self.block_manager.blocks_needed(len(tokens) % bs + max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"BeamSearchParams.beam_width={params.beam_width} with a {len(tokens)}-token prompt and "
                             f"max_tokens={max_tokens} may need {need} KV blocks; the cache has "
                             f"{self.block_manager.num_blocks}: lower beam_width or max_tokens")
        return make_beam_request(request_id, tokens, params, max_tokens, self.eos_token_ids, priority, arrival_time,
                                 **lora)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Finish requests now with finish_reason 'abort'; their KV blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            children = self.output_processor.child_ids(rid)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self._aborted_outputs += self.output_processor.finish_children(children, "abort")

    def has_unfinished_requests(self) -> bool:
        return (bool(self.output_processor.states) or bool(self._aborted_outputs) or self._inflight is not None
                or bool(self._older) or self._next is not None or bool(self._batches) or self.scheduler.has_kv_transfers())

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.states)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; with async scheduling, while it runs on the device, take
        in the results of the step launched before it (one step in flight when this returns),
        or with steps_ahead 2 of the step before that (two in flight, plain steps only)."""
        if self._max_batches > 1:
            return self._step_pipelined()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        self._sync_kv_connector()
        if self._inflight is not None and self.scheduler.beam_groups:
            # a beam's next token is chosen on the host from its whole group's results: no step
            # is scheduled before those are in
            outputs += self._take_older()
            outputs += self._complete(self._inflight)[0]
            self._inflight = None
        outputs += self._fail_broken_grammars()
        forward = None
        if self._next is not None:  # scheduled by the constrained step before (_pipeline_next)
            sched, forward, self.last_step = self._next
            self._next = None
        else:
            sched = self._schedule()
        ahead = self._inflight is not None and forward is None and self._runs_ahead(sched)
        if self._older and not ahead:
            outputs += self._take_older(sched)  # (what follows sees one step in flight at most)
        if forward is None and self._inflight is not None and not ahead and self._needs_sync(sched):
            outputs += self._take_inflight(sched).outputs
        with self.profiler.phase("minivllm.launch"):
            launched = self._launch(sched, outputs, forward)
        outputs += self._take_in_behind(launched, ahead)
        self._inflight = launched
        if launched is not None and (not self.async_scheduling or self._speculates(launched[0])):
            outputs += self._complete(launched)[0]
            self._inflight = None
        if launched is None and self._inflight is None and self.structured.num_compiling:
            self.structured.wait_for_compiles(0.02)  # only grammars are left to wait for: sleep
        if self.kv_connector is not None:
            self._hand_kv_jobs()  # blocks held by requests finished this step: pullable at once
            if launched is None and self._inflight is None and self.scheduler.has_kv_transfers():
                self.kv_connector.wait(KV_IDLE_WAIT_S)  # only KV transfers are left to wait for
        self._log_spec_stats()
        return outputs

    def _hand_kv_jobs(self) -> None:
        jobs = self.scheduler.take_kv_jobs()
        if jobs:
            self.kv_connector.cancel_pulls(jobs.cancels)  # (before any poll can apply them)
            self.kv_connector.register_sends(jobs.sends)
            self.kv_connector.start_pulls(jobs.pulls)

    def _sync_kv_connector(self) -> None:
        """Hands the scheduler's sends, pulls and cancels to the connector, then takes in what it
        finished: released producer blocks are freed, pulled requests can be scheduled (their
        K/V is in the cache, copied on the compute stream before this step's launch)."""
        if self.kv_connector is None:
            return
        self._hand_kv_jobs()
        sent, pulled = self.kv_connector.poll()
        if sent or pulled:
            self.scheduler.finish_kv_transfers(sent, pulled)

    def _schedule(self):
        t = time.perf_counter()
        with self.profiler.phase("minivllm.schedule"):
            sched = self.scheduler.schedule()
        self.last_step = {"schedule": time.perf_counter() - t, "tokens": sched.num_scheduled_tokens,
                          "seqs": len(sched.scheduled), "running": self.scheduler.num_running}
        if self._record_steps and not sched.is_empty:
            self.history.record(sched, self.scheduler, self.block_manager, self.generation_tokens_total)
        return sched

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallelism: launch a new batch of requests not already in flight, and take in
        the oldest batch's results once every stage has one (or nothing new could be launched)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        outputs += self._fail_broken_grammars()
        launched = self._launch(self._schedule(), outputs)
        if launched is not None:
            self._batches.append(launched)
        if self._batches and (launched is None or len(self._batches) >= self._max_batches):
            outputs += self._complete(self._batches.popleft())[0]
        return outputs

    def _take_inflight(self, next_sched, fill_handles: list | None = None, beside_fill=None) -> TakenIn:
        """Completes the step in flight (see _take_in). If it failed, the step scheduled after it
        (launched, or to be launched all the same, so the runner's request state stays in step)
        may read what the failed one never wrote: its requests fail too; its device work still
        finishes first."""
        taken = self._take_in(self._inflight, fill_handles, beside_fill)
        self._inflight = None
        if not taken.ok and next_sched is not None:
            taken.outputs += self._fail_scheduled(next_sched)
        return taken

    def _take_in_behind(self, launched, ahead: bool) -> list[RequestOutput]:
        """After a launch, the steps launched before it: with `ahead` (a plain step, see
        _runs_ahead) steps_ahead - 1 of them stay in flight, oldest taken in first; else all are
        taken in. Leaves self._inflight None."""
        if self._inflight is None:
            return []
        then = launched[0] if launched is not None else None
        if launched is not None and ahead:
            self._older.append(self._inflight)  # still in flight: taken in now or after the next launch
            self._inflight = None
            self.num_steps_ahead += 1
            return self._take_older(then, keep=self._steps_ahead - 1)
        outputs = self._take_older(then)
        return outputs + self._take_inflight(then).outputs

    def _runs_ahead(self, sched) -> bool:
        """Whether steps launched before this one may stay in flight (steps_ahead > 1) while it
        is launched: a plain step. Not one that preempts or requeues (a request put back must
        not be admitted again before the steps it was in are taken in: their tokens would be
        taken for the new run's), moves KV, has beams, or has a request whose sampling needs
        the tokens before it on the host (penalties, a grammar's bitmask)."""
        if (self._steps_ahead == 1 or sched.preempted_req_ids or sched.kv_transfers or self.scheduler.beam_groups
                or self._needs_sync(sched)):
            return False
        reqs = self.scheduler.requests
        return not any(s.req_id in reqs and reqs[s.req_id].grammar is not None for s in sched.scheduled)

    def _take_older(self, then=None, keep: int = 0) -> list[RequestOutput]:
        """Takes in the steps launched before self._inflight, oldest first, until `keep` are
        left. One that failed fails the requests of every step launched after it (and of
        `then`, the step launched or about to be): they may read K/V it never wrote."""
        outputs = []
        while len(self._older) > keep:
            taken = self._take_in(self._older.popleft())
            outputs += taken.outputs
            if not taken.ok:
                later = [step[0] for step in (*self._older, self._inflight) if step is not None]
                for sched in later + ([then] if then is not None else []):
                    outputs += self._fail_scheduled(sched)
        return outputs

    def _needs_sync(self, sched) -> bool:
        """Penalties need the previous step's token values on the host before sampling; so do a
        speculative step's verify and proposals (every request's tokens so far)."""
        reqs = self.scheduler.requests
        return not self.async_scheduling or self._speculates(sched) or any(
            s.req_id in reqs and reqs[s.req_id].sampling_params.uses_penalties for s in sched.scheduled)

    def _speculates(self, sched) -> bool:
        """With speculative decoding, whether the step verifies drafts or proposes new ones (the
        runner's choice, made the same way): such a step runs synchronously, since the next
        one is scheduled with its proposals. Others (a batch above disable_by_batch_size) are
        plain steps, kept in flight with async scheduling."""
        spec = self.config.speculative
        if spec is None:
            return False
        rows = [s for s in sched.scheduled if s.samples]
        return spec.speculates(len(rows), any(s.num_draft_tokens for s in rows))

    def _launch(self, sched, outputs: list[RequestOutput], forward=None):
        """Launches the step: (sched, launched step), or None if there is nothing to run. A step
        with constrained rows launches its forward, takes in the step in flight (the grammars
        need its tokens), fills the bitmask while the forward runs, then launches the sampling.
        forward: the step's forward, queued already by the step before (_pipeline_next)."""
        if forward is None and sched.is_empty and not sched.finished_req_ids and not sched.preempted_req_ids \
                and not sched.kv_transfers:
            return None
        t = time.perf_counter()
        nxt = deferred = None
        try:
            handles = self._grammar_handles(sched)
            if not handles:
                if forward is None:
                    return sched, self.executor.launch(sched)
                return sched, self.executor.launch_sampling(forward, None)
            if forward is None:
                forward = self.executor.launch_forward(sched)
            if self._inflight is None:
                bitmask = self.structured.bitmask(handles)
            else:
                t = self._add_time("launch", t)  # the wait, update and outputs below are timed on their own
                taken = self._take_inflight(sched, fill_handles=handles, beside_fill=self._schedule_next)
                outputs += taken.outputs
                deferred = taken.deferred
                if taken.error is not None:
                    raise taken.error
                bitmask = taken.bitmask
                if bitmask is None:
                    # none filled (the step in flight failed, or the fill raised): fill here, where
                    # a failure fails this step alone, the step before's outputs already taken
                    bitmask = self.structured.bitmask(handles)
                # (timed as "pipeline", not "launch")
                nxt = taken.next if taken.deferred is not None else self._schedule_next()
                t = time.perf_counter()
            launched = sched, self.executor.launch_sampling(forward, bitmask)
        except ExecutorDeadError as e:
            self._flush_outputs(deferred, outputs)
            self._aborted_outputs += self._die(e)
            return None
        except Exception as e:
            self._flush_outputs(deferred, outputs)
            self._aborted_outputs += self._fail_scheduled(sched, e)
            if nxt is not None:  # scheduled behind the failed step: it may read what that never wrote
                self._aborted_outputs += self._fail_scheduled(nxt[0])
            return None
        finally:
            self._add_time("launch", t)
        if nxt is not None:
            self._pipeline_next(*nxt)
        self._flush_outputs(deferred, outputs)  # the step before's tokens, now that the device has work queued
        return launched

    def _flush_outputs(self, deferred: list | None, outputs: list[RequestOutput]) -> None:
        """The outputs of updates whose processing _take_in left for later (see TakenIn)."""
        if not deferred:
            return
        done, stopped = self._make_outputs(deferred)
        outputs += done
        if stopped:  # (none can be: deferred only when no request of the step has stop strings)
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

    def _make_outputs(self, updates) -> tuple[list[RequestOutput], list[str]]:
        """The RequestOutputs of a step's updates (detokenization), and the requests a stop
        string ended (to finish, after any fill is joined); timed as "outputs"."""
        t = time.perf_counter()
        with self.profiler.phase("minivllm.outputs"):
            done, stopped = self.output_processor.process(updates)
        self._add_time("outputs", t)
        return done, stopped

    def _schedule_next(self):
        """With a constrained step's sampling still to queue, the step after it is scheduled now:
        (its SchedulerOutput, its inputs built on the host, its schedule record), or None.

        Why (issue 18, W7 trace on an H100, lease 10): a constrained step queues its forward,
        takes in the step before and fills the bitmask while the forward runs, then queues its
        sampling. The next step was scheduled and built only after that, while the device had
        just the sampling (~2 ms of W7's 17 ms step) to run: the device waited for the host
        between the steps, and W7 ran 26 ms a step against 18 ms unconstrained with the same
        kernel time. Scheduling and building the next step here, before this step's sampling is
        queued, lets its forward follow the sampling at once (_pipeline_next). The scheduler
        sees what it sees with async scheduling: the step before taken in, this one in flight.
        Steps that must run synchronously (penalties) or move KV are only scheduled here."""
        if not self._can_pipeline or self.scheduler.beam_groups or self.dead_error is not None:
            return None
        record, t = self.last_step, time.perf_counter()
        nxt = self._schedule()
        record, self.last_step = self.last_step, record
        inputs = None
        if not (nxt.is_empty or nxt.kv_transfers or self._needs_sync(nxt)):
            inputs = self.executor.prepare_forward(nxt)
        self._add_time("pipeline", t)
        return nxt, inputs, record

    def _pipeline_next(self, nxt, inputs, record) -> None:
        """Queues the forward of the step _schedule_next built (right behind this step's
        sampling, whose tokens it reads on the device) and leaves it for the next step()."""
        if inputs is None:
            self._next = (nxt, None, record)
            return
        t = time.perf_counter()
        try:
            self._next = (nxt, self.executor.launch_forward(nxt, inputs), record)
            self.num_pipelined_steps += 1
        except ExecutorDeadError as e:
            self._aborted_outputs += self._die(e)
        except Exception as e:
            self._aborted_outputs += self._fail_scheduled(nxt, e)
        self._add_time("pipeline", t)

    def _grammar_handles(self, sched) -> list:
        """The grammars of the step's sampling rows, in row order."""
        reqs = self.scheduler.requests
        return [reqs[s.req_id].grammar for s in sched.scheduled
                if s.samples and s.req_id in reqs and reqs[s.req_id].grammar is not None]

    def _fail_broken_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile end with finish_reason "error"; the rest run on."""
        failed = self.structured.take_failed()
        for rid, err in failed:
            logger.warning("request %s: its grammar failed to compile: %s", rid, err)
        ids = [rid for rid, _ in failed]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return self.output_processor.finish_children(ids, "error")

    def _complete(self, inflight) -> tuple[list[RequestOutput], bool]:
        """Waits for a launched step and takes in its results: (outputs, whether it succeeded)."""
        taken = self._take_in(inflight)
        return taken.outputs, taken.ok

    def _take_in(self, inflight, fill_handles: list | None = None, beside_fill=None) -> TakenIn:
        """_complete, and with fill_handles (a constrained step launched behind this one) also
        that step's bitmask. The fill starts on the grammar manager's thread as soon as this
        step's tokens have advanced the grammars, runs beside this thread's work (xgrammar
        releases the GIL), and is joined before any request is finished (finishing releases
        matchers).

        beside_fill (the engine's _schedule_next) is what this thread does beside the fill when
        no request of the step has stop strings: then the output processing (detokenization)
        cannot stop a request, so it changes no scheduling decision, and it is left to the
        caller (TakenIn.deferred), which makes it after queueing the constrained step's sampling
        and the next forward. The host's critical path between two samplings is then the update,
        the longer of the fill and the next step's scheduling and input build, and the sampling's
        launch (issue 18: W7's constrained steps were host-bound, lease 11). With stop strings
        the order stays update, outputs beside the fill, join, stops, and the caller schedules."""
        sched, launched = inflight
        t = time.perf_counter()
        try:
            with self.profiler.phase("minivllm.wait"):
                result = self.executor.finish(launched)
        except ExecutorDeadError as e:
            return TakenIn(self._die(e), False)
        except Exception as e:
            return TakenIn(self._fail_scheduled(sched, e), False)
        t = self._add_time("wait", t)
        with self.profiler.phase("minivllm.update"):
            updates = self.scheduler.update(sched, result)
            self._count_tokens(updates)
        self._add_time("update", t)
        fill, switch = None, None
        if fill_handles:
            # the fill thread needs the GIL to start and to finish (xgrammar's fill itself releases
            # it) while this thread detokenizes, a pure-Python loop that keeps the GIL for the
            # whole 5 ms switch interval: each handoff cost up to 5 ms of the step. A short
            # interval while both run hands it over within FILL_SWITCH_INTERVAL_S
            switch = sys.getswitchinterval()
            sys.setswitchinterval(FILL_SWITCH_INTERVAL_S)
            fill = self.structured.fill_async(fill_handles)
        early = beside_fill is not None and fill is not None and not any(u.request.sampling_params.stop
                                                                          for u in updates)
        error = None
        try:
            if early:
                self.num_early_schedules += 1
                try:
                    nxt = beside_fill()  # (times itself as "pipeline")
                except Exception as e:  # noqa: BLE001 - raised by the caller after these outputs are out
                    error = e
                else:
                    bitmask = self._join_fill(fill, time.perf_counter())
                    return TakenIn([], True, bitmask, deferred=updates, next=nxt)
            new_outputs, stopped = self._make_outputs(updates)
            bitmask = self._join_fill(fill, time.perf_counter()) if fill is not None else None
        finally:
            if switch is not None:
                sys.setswitchinterval(switch)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return TakenIn(new_outputs, True, bitmask, error=error)

    def _join_fill(self, fill, since: float):
        """The fill's bitmask, or None if it raised (the caller then fills again on its own
        thread, where a failure fails only the constrained step); the wait is timed as fill_wait."""
        try:
            return fill.result()
        except Exception:  # noqa: BLE001
            return None
        finally:
            self._add_time("fill_wait", since)

    def _add_time(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.last_step[phase] = self.last_step.get(phase, 0.0) + now - since
        return now

    def _count_tokens(self, updates) -> None:
        for u in updates:
            self.generation_tokens_total += len(u.new_token_ids)
            first = u.new_token_ids and u.request.num_output_tokens == len(u.new_token_ids)
            if first or u.pooled is not None:  # its first token (or its embedding): prompt done
                self.prompt_tokens_total += u.request.num_prompt_tokens

    def _fail_scheduled(self, sched, error: BaseException | None = None) -> list[RequestOutput]:
        """A step raised: its requests end with "error", or, when the fault was some requests'
        own (RequestFault), those alone do and the others are recomputed. Either way the blocks
        the step was to write are unpublished first (their hashes were registered when it was
        scheduled) and freed with their requests."""
        reqs = self.scheduler.requests
        for s in sched.scheduled:  # their new K/V was never written: unpublish those blocks
            if s.req_id in reqs:
                self.block_manager.forget_unwritten(reqs[s.req_id], s.num_computed_tokens)
        children = [s.req_id for s in sched.scheduled]
        if isinstance(error, RequestFault):
            culprits = set(error.req_ids)
            logger.warning("a step failed for requests %s (%s); the step's %d others are recomputed",
                           sorted(culprits), error, len(children) - len(culprits & set(children)))
            self.scheduler.requeue([c for c in children if c not in culprits])
            children = [c for c in children if c in culprits]
        elif error is not None:
            logger.error("model step failed; failing the step's %d requests", len(children), exc_info=error)
        # a beam's output belongs to its beam-search request (the whole group fails)
        outputs_of = [reqs[c].beam.request_id if c in reqs and reqs[c].beam is not None else c for c in children]
        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
        return self.output_processor.finish_children(list(dict.fromkeys(outputs_of)), "error")

    def _die(self, error: BaseException) -> list[RequestOutput]:
        """A rank is gone: no step can run again. Every request ends now with finish_reason
        'error'; later add_request calls raise EngineDeadError (the server's /health: 503)."""
        if self.dead_error is None:
            logger.error("the engine is dead, failing every request: %s", error)
            self.dead_error = error
        self._inflight = None
        self._older.clear()
        self._next = None
        self._batches.clear()
        children = [c for rid in list(self.output_processor.states) for c in self.output_processor.child_ids(rid)]
        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
        return self.output_processor.finish_children(children, "error")

    def check_health(self) -> None:
        """Raises EngineDeadError if a rank died (found now, or by an earlier step); then every
        request still there has been failed, its error outputs left for the next step()."""
        if self.dead_error is None:
            try:
                self.executor.check_health()
            except ExecutorDeadError as e:
                self._aborted_outputs += self._die(e)
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")

    def get_stats(self) -> EngineStats:
        bm, spec = self.block_manager, self.scheduler.spec_stats
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.usage, bm.num_blocks,
                           bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits, self.scheduler.num_preemptions,
                           self.prompt_tokens_total, self.generation_tokens_total, spec.num_drafts,
                           spec.num_draft_tokens, spec.num_accepted_tokens, tuple(spec.accepted_per_pos),
                           self.scheduler.tokens_in_flight, self.executor.expert_token_counts(),
                           **self._host_kv_stats())

    def _host_kv_stats(self) -> dict[str, int]:
        swap, offload = self.scheduler.swap, self.block_manager.offload
        out, in_ = (swap.num_blocks_swapped_out, swap.num_blocks_swapped_in) if swap else (0, 0)
        hits, stored = (offload.num_loaded_blocks, offload.num_stored_blocks) if offload else (0, 0)
        return {"num_blocks_swapped_out": out, "num_blocks_swapped_in": in_,
                "num_swapped": len(swap.swapped) if swap else 0, "offload_hit_blocks": hits,
                "offload_stored_blocks": stored,
                "kv_transfer_bytes": (out + in_ + hits + stored) * (self.host_kv.block_bytes if self.host_kv else 0),
                "kv_pulled_blocks": self.scheduler.num_kv_pulled_blocks,
                "kv_pull_failures": self.scheduler.num_kv_pull_failures,
                "kv_held_requests": len(self.scheduler.sending)}

    def _log_spec_stats(self) -> None:
        """Every SPEC_LOG_INTERVAL_S with speculative decoding: the acceptance since the last line."""
        now = time.monotonic()
        if self.config.speculative is None or now - self._spec_logged[0] < SPEC_LOG_INTERVAL_S:
            return
        spec, (_, last) = self.scheduler.spec_stats, self._spec_logged
        drafts, proposed, accepted = (spec.num_drafts - last[0], spec.num_draft_tokens - last[1],
                                      spec.num_accepted_tokens - last[2])
        self._spec_logged = (now, (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens))
        if drafts:
            logger.info("speculative decoding (%s): acceptance rate %.1f %%, mean acceptance length %.2f, "
                        "%d drafts, %d draft tokens, %d accepted; per position since start %s",
                        self.config.speculative.method, 100.0 * accepted / max(proposed, 1), 1 + accepted / drafts,
                        drafts, proposed, accepted,
                        [round(a / spec.num_drafts, 2) for a in spec.accepted_per_pos])

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def release_held_kv(self) -> None:
        """Shutting down: a prefill instance's blocks held for decode instances are released (freed
        at the next step); a later pull fails and that decode instance recomputes the prompt."""
        if self.kv_connector is not None and self.kv_connector.server is not None:
            self.kv_connector.server.release_all()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        unfreeze_heap()  # the engine's cyclic garbage (runner <-> graph runner) can now be freed


def make_engine(config: EngineConfig):
    """LLMEngine, or a DataParallelEngine of data_parallel_size LLMEngines (same interface)."""
    if config.parallel.data_parallel_size > 1:
        from minivllm.engine.dp_engine import DataParallelEngine
        return DataParallelEngine(config)
    return LLMEngine(config)
