"""Iteration-level scheduler: one rule for prefill, chunked prefill, prefix hits, decode and
recompute after preemption.

Each request has num_tokens (prompt + generated) and num_computed_tokens (in the KV cache).
Every step hands out a token budget so num_computed_tokens catches up with num_tokens:
running requests first (decodes and unfinished prefill chunks, in admission order), then
waiting requests fill what is left. While requests are decoding, prompt tokens per step can
be capped (max_prefill_tokens_with_decodes) so that a prompt arriving mid-stream never stalls
the decoding requests for one long step. When blocks run out, the lowest-priority running
request is preempted: its blocks are freed and it is recomputed later (its output so far is
kept), or, with swap space (core/swap_space.py), its computed blocks are copied to host memory
and copied back when it resumes. Block copies travel in SchedulerOutput.kv_transfers.

num_computed_tokens advances when tokens are scheduled, so the next step can be scheduled while
this one runs (async scheduling): a token the running step will sample counts as pending
(num_pending_tokens) and goes to the runner as PLACEHOLDER_TOKEN; update() later turns it into
a real token and checks the stop conditions, one step late.

Pipeline parallelism keeps up to max_concurrent_batches whole batches in flight (one per stage)
instead: a request scheduled in a batch is not scheduled again, nor preempted, until update()
took in that batch's results (a later stage could not fill in a placeholder).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from minivllm.core.beam import BeamGroup
from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import (
    PLACEHOLDER_TOKEN,
    KVJobs,
    KVPull,
    KVSend,
    KVTransfers,
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from minivllm.core.queues import RequestQueue, make_request_queue
from minivllm.core.request import Request, RequestStatus
from minivllm.core.swap_space import SwapSpace


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # or "priority"
    enable_chunked_prefill: bool = True
    # Inter-token latency guard (stall-free batching, as in Sarathi-Serve): while some running
    # request is decoding and at most LIGHT_LOAD_WAITING requests wait, a step carries at most
    # this many prompt tokens; the rest of a prompt is chunked into the next steps. A step's
    # time grows with its tokens (~18 us each for Qwen3-8B on an H200), and every decoding
    # request waits for the whole step. Under a longer queue (a backlog) the cap is half the
    # step budget (if larger): prompts are admitted almost as fast, since a step's GPU time is
    # about proportional to its tokens, while decoding requests wait half as long per step.
    # None: no cap.
    max_prefill_tokens_with_decodes: int | None = None
    # Speculative decoding: KV slots past a step's tokens that the proposer writes (a draft
    # model's forward passes), allocated with the step's blocks; and the number of decoding
    # requests above which no drafts are scheduled (None: always).
    num_lookahead_tokens: int = 0
    spec_disable_batch_size: int | None = None
    # batches in flight at once (pipeline stages); above 1 a request sits out while in flight
    max_concurrent_batches: int = 1
    # multi-LoRA: distinct adapters the running requests may use at once (the runner's device
    # slots); a request of another adapter waits. None: no adapters
    max_loras: int | None = None


LIGHT_LOAD_WAITING = 4  # queue length up to which the prefill cap above applies


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters, vLLM's: drafts (requests that verified proposals), draft
    tokens verified, accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos += [0] * (num_draft - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step yields on average: the accepted drafts plus the one it samples."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, for output processing. A finished beam-search group
    comes as one update of one of its beams (request.beam.result holds the hypotheses)."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    prompt_logprobs: list[TokenLogprobs] | None = None  # the step's prompt logprobs, in position order
    pooled: list[float] | None = None  # an embedding request's vector (it is then finished)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, swap: SwapSpace | None = None) -> None:
        self.limits = limits
        self.block_manager = block_manager
        self.swap = swap  # swap preemption's host blocks (None: preemption always recomputes)
        self.waiting: RequestQueue = make_request_queue(limits.policy)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._prefill_left = limits.max_num_batched_tokens  # prompt tokens the step being scheduled may still take
        self._finished_since_last_step: set[str] = set()
        self._requeued_since_last_step: set[str] = set()  # requeue(): the runner drops their state
        self._sent_to_runner: set[str] = set()
        self.beam_groups: dict[str, BeamGroup] = {}  # beam-search requests by their request id
        self._unsent_forks: set[str] = set()  # running forked beams the runner has not seen yet
        self._in_flight: set[str] = set()  # (max_concurrent_batches > 1) in a batch not yet updated
        self._batch_cap: int | None = None  # (max_concurrent_batches > 1) requests one batch may hold
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # prompt + max_tokens of every unfinished request: what the engine may still have to hold
        self.tokens_in_flight = 0
        # disaggregated prefill/decode (kv_transfer/): this producer's (engine id, host, port),
        # set by the engine once its connector listens (None: not a producer)
        self.kv_address: tuple[str, str, int] | None = None
        self.kv_jobs = KVJobs()  # for the connector, taken by the engine before each step
        self.sending: dict[str, Request] = {}  # finished producer requests holding blocks for a pull
        self.pulling: dict[str, Request] = {}  # consumer requests whose prompt K/V is being pulled
        self.num_kv_pulled_blocks = 0
        self.num_kv_pull_failures = 0  # pulls given up: the prompt was recomputed here

    # ---- requests in and out --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        if req.beam is not None:  # the prompt is the group's first beam
            assert req.beam.request_id not in self.beam_groups, f"duplicate request id {req.beam.request_id}"
            self.beam_groups[req.beam.request_id] = req.beam
            req.beam.add_root(req)
        self.requests[req.request_id] = req
        self.tokens_in_flight += req.num_prompt_tokens + req.max_tokens
        self.waiting.push(req)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (stop string, abort, error) requests wherever they are; frees their blocks now.
        A beam-search request id, or any of its beams, finishes every beam of the group."""
        assert status.finished
        done = []
        for req in self._expand_beams(req_ids):
            if req.is_finished:
                continue
            self._unqueue(req)
            req.status = status
            # (its output is already out without the hand-off: a stop string, an abort, an error)
            req.remote_decode = False
            self._release(req)
            done.append(req)
        return done

    def _expand_beams(self, req_ids: Iterable[str]) -> list[Request]:
        out: dict[str, Request] = {}
        for req_id in req_ids:
            group = self.beam_groups.get(req_id)
            req = self.requests.get(req_id)
            if group is None and req is not None and req.beam is not None:
                group = req.beam
            if group is not None:
                self.beam_groups.pop(group.request_id, None)
                out.update((r.request_id, r) for r in group.live)
                group.live = []
            elif req is not None:
                out[req_id] = req
        return list(out.values())

    def _unqueue(self, req: Request) -> None:
        """Take a request out of the running list or the waiting queue (a parked beam is in neither)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # its blocks are freed now: the connector must never write the pulled K/V into them
            # (the cancel reaches it before its next poll, which is where pulls are applied)
            self.pulling.pop(req.request_id, None)
            self.kv_jobs.cancels.append(req.request_id)
        elif req.parked:
            req.parked = False
        else:
            self.waiting.remove(req)

    def _release(self, req: Request) -> None:
        if not self._hold_for_remote_decode(req):
            self.block_manager.free(req)
        self._unsent_forks.discard(req.request_id)
        if self.swap is not None:
            self.swap.discard(req.request_id)
        if req.grammar is not None:
            req.grammar.release()
        self._in_flight.discard(req.request_id)
        if self.requests.pop(req.request_id, None) is not None:
            self.tokens_in_flight -= req.num_prompt_tokens + req.max_tokens
        if req.group is not None:
            req.group.prompt_computed = True  # never leave siblings waiting on a finished leader
        if req.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(req.request_id)
            self._finished_since_last_step.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- disaggregated prefill/decode -----------------------------------------------------
    def _hold_for_remote_decode(self, req: Request) -> bool:
        """A producer's request that finished normally keeps its blocks (pinned: not freed, so
        never evicted or rewritten) until the connector says a consumer pulled them or the send
        timed out; its output says where they are."""
        if not req.remote_decode or self.kv_address is None or req.status not in (
                RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            return False
        from minivllm.kv_transfer.params import producer_answer
        block_ids = self.block_manager.block_ids(req.request_id)
        engine_id, host, port = self.kv_address
        req.kv_transfer_params_out = producer_answer(engine_id, req.request_id, block_ids, host, port,
                                                     req.prompt_token_ids, self.block_manager.block_size)
        self.sending[req.request_id] = req
        self.kv_jobs.sends.append(KVSend(req.request_id, block_ids))
        return True

    def take_kv_jobs(self) -> KVJobs:
        jobs, self.kv_jobs = self.kv_jobs, KVJobs()
        return jobs

    def has_kv_transfers(self) -> bool:
        """Blocks held for a consumer, or requests waiting for their pulls (the engine keeps
        stepping, to hear when they are done)."""
        return bool(self.sending or self.pulling)

    def finish_kv_transfers(self, sent: Iterable[str], pulled: dict[str, bool]) -> None:
        """The connector's news: producer requests whose blocks were pulled (or whose send timed
        out) free them; pulled consumer requests (True) count the prompt but its last token as
        computed and queue first in line, failed pulls (False) are recomputed here."""
        for req_id in sent:
            req = self.sending.pop(req_id, None)
            if req is not None:
                self.block_manager.free(req)
        for req_id, ok in pulled.items():
            req = self.pulling.pop(req_id, None)
            if req is None:
                continue  # aborted meanwhile (its blocks are already free)
            req.status = RequestStatus.WAITING
            if ok:
                req.num_computed_tokens = req.num_prompt_tokens - 1
                req.remote_kv_loaded = True
                self.block_manager.register_computed_blocks(req)
            else:
                self.block_manager.free(req)
                req.num_computed_tokens = 0
                req.remote_prefill = None
                self.num_kv_pull_failures += 1
            self.waiting.push_front(req)

    def _pull_check(self, req: Request) -> str | None:
        """Why this request cannot take the producer's K/V (None: it can)."""
        remote, bs = req.remote_prefill, self.block_manager.block_size
        if req.max_cached_prefix is not None:
            return "its prompt logprobs need every prompt position computed here"
        if remote.block_size != bs:
            return f"block size {remote.block_size} != this engine's {bs}"
        if remote.num_tokens != req.num_prompt_tokens or req.num_output_tokens:
            return f"the producer computed {remote.num_tokens} tokens, this prompt has {req.num_prompt_tokens}"
        from minivllm.kv_transfer.params import prompt_hash
        if remote.prompt_hash != prompt_hash(req.prompt_token_ids):
            return "the producer computed another prompt"
        if len(remote.block_ids) < self.block_manager.blocks_needed(req.num_prompt_tokens - 1):
            return f"{len(remote.block_ids)} remote blocks do not hold {req.num_prompt_tokens - 1} tokens"
        return None

    def _start_pull(self, req: Request) -> bool:
        """Blocks for the prompt but its last token (after the local prefix-cache hit), and a pull
        of the producer's blocks for the rest into them; the request waits (others run). False:
        no room now. A request that cannot take the producer's K/V is computed here instead."""
        why = self._pull_check(req)
        if why is not None:
            import logging
            logging.getLogger(__name__).warning("request %s: recomputing its prompt, the remote K/V cannot be "
                                                "used: %s", req.request_id, why)
            self.kv_jobs.pulls.append(KVPull(req.request_id, req.remote_prefill, [], []))  # releases them
            req.remote_prefill = None
            self.num_kv_pull_failures += 1
            return True
        cached = self.block_manager.find_cached_prefix(req)
        num_cached = len(cached) * self.block_manager.block_size
        if self.block_manager.allocate(req, req.num_prompt_tokens - 1 - num_cached, cached) is None:
            return False
        self.waiting.pop()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.pulling[req.request_id] = req
        first, last = len(cached), self.block_manager.blocks_needed(req.num_prompt_tokens - 1)
        local = self.block_manager.block_ids(req.request_id)[first:last]
        remote = list(req.remote_prefill.block_ids[first:last])
        self.kv_jobs.pulls.append(KVPull(req.request_id, req.remote_prefill, local, remote))
        self.num_kv_pulled_blocks += len(local)
        return True

    def _resume_pulled(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """A request whose prompt K/V arrived: its last prompt token is computed here, which
        samples the first output token. Returns the tokens scheduled (0: no room)."""
        n = req.num_tokens - req.num_computed_tokens
        if n > budget or n > self._prefill_left:
            return 0
        if self.block_manager.allocate(req, n) is None:
            return 0
        self.waiting.pop()
        req.remote_kv_loaded = False
        req.remote_prefill = None
        self._admit(req, req.num_computed_tokens, out)
        # the runner meets the request now: its whole block table goes with this first step
        self._add_scheduled(out, req, n, self.block_manager.block_ids(req.request_id))
        return n

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.limits.max_num_batched_tokens
        self._prefill_left = self._prefill_cap()
        self._batch_cap = self._pipeline_batch_cap()
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        if not out.scheduled and self.waiting and self._park_reported_beams(out):
            self._schedule_waiting(out, budget)
        out.num_scheduled_tokens = sum(len(s.token_ids) for s in out.scheduled)
        out.preempted_req_ids |= self._requeued_since_last_step
        self._requeued_since_last_step = set()
        self._collect_transfers(out)
        return out

    def _collect_transfers(self, out: SchedulerOutput) -> None:
        """The offload tier's copies of this step join the swaps in out.kv_transfers."""
        offload = self.block_manager.offload
        if offload is not None:
            stores, loads = offload.take_transfers()
            if stores or loads:
                out.kv_transfers = out.kv_transfers or KVTransfers()
                out.kv_transfers.offload += stores
                out.kv_transfers.load += loads

    def _prefill_cap(self) -> int:
        """Prompt tokens this step may carry (see SchedulerLimits.max_prefill_tokens_with_decodes)."""
        cap, budget = self.limits.max_prefill_tokens_with_decodes, self.limits.max_num_batched_tokens
        if cap is None or not self.limits.enable_chunked_prefill:
            return budget  # (unchunked prompts must fit whole)
        if not any(r.num_tokens_with_pending - r.num_computed_tokens == 1 for r in self.running):
            return budget  # nobody decodes: nobody waits for a long step
        if len(self.waiting) > LIGHT_LOAD_WAITING:
            return max(cap, budget // 2)
        return cap

    def _pipeline_batch_cap(self) -> int | None:
        """Pipeline parallelism: at most 1 / max_concurrent_batches of the requests in one batch.
        Without it the first batch takes every decoding request (the token budget allows them
        all), the next finds none left, and each stage idles while the others work: W1 on
        Qwen3-32B at pp=2 ran at half of tp=2's throughput (H100 x4, 2026-11-26)."""
        batches = self.limits.max_concurrent_batches
        if batches <= 1:
            return None
        active = min(len(self.running) + len(self.waiting), self.limits.max_num_seqs)
        return max(1, -(-active // batches))

    def _batch_full(self, out: SchedulerOutput) -> bool:
        return self._batch_cap is not None and len(out.scheduled) >= self._batch_cap

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and not self._batch_full(out):
            req = self.running[i]
            if req.request_id in self._in_flight:
                i += 1  # its batch is still in the pipeline
                continue
            remaining = req.num_tokens_with_pending - req.num_computed_tokens
            prefilling = remaining > 1  # an unfinished prompt, or a recompute after preemption
            n = min(remaining, budget, self._prefill_left if prefilling else budget)
            if n <= 0 or self._finishes_with_pending(req) or (req.beam is not None and req.num_pending_tokens):
                i += 1
                continue
            drafts = [] if prefilling else self._drafts_to_verify(req, budget - n)
            lookahead = self._lookahead(req, req.num_computed_tokens, n)
            new_blocks = self.block_manager.allocate(req, n + len(drafts) + lookahead)
            if new_blocks is None and (drafts or lookahead):
                # speculation is optional: it never preempts anyone (nor keeps a request from fitting)
                drafts, lookahead = [], 0
                new_blocks = self.block_manager.allocate(req, n)
            n += len(drafts)
            victim = None
            while new_blocks is None:
                victim = self._pick_victim()
                if victim is None:
                    break  # every other request is in flight: this one waits for a batch to finish
                if self.running.index(victim) < i:
                    i -= 1  # an earlier entry leaves the list
                budget += self._preempt(victim, out)
                if victim is req:
                    break
                new_blocks = self.block_manager.allocate(req, n + lookahead)
            if new_blocks is None:
                if victim is None:
                    i += 1
                continue  # (else req itself was preempted; running[i] is now the next request)
            self._add_scheduled(out, req, n, new_blocks, drafts)
            budget -= n
            if prefilling:
                self._prefill_left -= n
            i += 1
        return budget

    def _lookahead(self, req: Request, start: int, n: int) -> int:
        """KV slots past a step's n known tokens from `start` for a proposer's own forward passes
        (a draft model writes the sampled token and the drafts it feeds back): only when the step
        samples, never past max_model_len."""
        if self.limits.num_lookahead_tokens == 0 or start + n != req.num_tokens_with_pending:
            return 0
        last = min(self.limits.max_model_len, req.num_prompt_tokens + req.max_tokens)  # no token goes past
        return max(0, min(self.limits.num_lookahead_tokens, last - start - n))

    def _drafts_to_verify(self, req: Request, budget_left: int) -> list[int]:
        """The proposed tokens a decoding request verifies this step: as many as the budget
        left, max_tokens (the step may yield every draft plus one: never past the limit) and
        max_model_len allow; none while more requests decode than spec_disable_batch_size."""
        if not req.spec_token_ids:
            return []
        limit = self.limits.spec_disable_batch_size
        if limit is not None and len(self.running) > limit:
            return []
        room = min(budget_left, req.max_tokens - req.num_output_tokens - req.num_pending_tokens - 1,
                   self.limits.max_model_len - req.num_tokens_with_pending - 1)
        return req.spec_token_ids[:max(0, room)]

    def _finishes_with_pending(self, req: Request) -> bool:
        """The pending token is sure to be its last (length limit): computing more is waste."""
        if req.num_pending_tokens == 0:
            return False
        return (req.num_output_tokens + req.num_pending_tokens >= req.max_tokens
                or req.num_tokens_with_pending >= self.limits.max_model_len)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while (self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs
               and not self._batch_full(out)):
            req = self.waiting.peek()
            if self._must_wait(req) or self._no_lora_slot(req):
                skipped.append(self.waiting.pop())
                continue
            if req.remote_prefill is not None and not req.remote_kv_loaded:
                if not self._start_pull(req):
                    break  # no room: wait for running requests to finish
                continue
            if req.remote_kv_loaded:
                n = self._resume_pulled(req, out, budget)
                if n == 0:
                    break
                budget -= n
                self._prefill_left -= n
                continue
            if self.swap is not None and req.request_id in self.swap.swapped:
                n = self._swap_in(req, out, budget)
                if n == 0:
                    break  # no room: wait for running requests to finish
                budget -= n
                self._prefill_left -= n
                continue
            cached = self.block_manager.find_cached_prefix(req)
            num_cached = len(cached) * self.block_manager.block_size
            n = req.num_tokens - num_cached
            if n > budget and not self.limits.enable_chunked_prefill:
                break  # (without chunking the cap is off: _prefill_left >= budget)
            n = min(n, budget, self._prefill_left)
            if n <= 0:
                break  # the prefill cap is used up: the next step takes the rest
            lookahead = self._lookahead(req, num_cached, n)
            new_blocks = self.block_manager.allocate(req, n + lookahead, cached)
            if new_blocks is None and lookahead:  # (optional: never what keeps a prompt out)
                new_blocks = self.block_manager.allocate(req, n, cached)
            if new_blocks is None:
                break  # no room: wait for running requests to finish
            self.waiting.pop()
            self._admit(req, num_cached, out)
            self._add_scheduled(out, req, n, new_blocks)
            budget -= n
            self._prefill_left -= n
        # back to the front, in their order: a sibling that had to wait keeps its FCFS place
        # (push() would append it behind requests that arrived later)
        for req in reversed(skipped):
            self.waiting.push_front(req)

    def _no_lora_slot(self, req: Request) -> bool:
        """The request's adapter would be one more than the runner's max_loras device slots."""
        lora = req.lora_int_id
        if lora is None or self.limits.max_loras is None:
            return False
        running = {r.lora_int_id for r in self.running if r.lora_int_id is not None}
        return lora not in running and len(running) >= self.limits.max_loras

    def _swap_in(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """Resume a swapped request: device blocks for its swapped ones and its next tokens, the
        swapped ones copied back before the step's forward. Returns the tokens scheduled (0: no room)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget, self._prefill_left)  # (>= 1 token left)
        if n <= 0:
            return 0
        new_blocks = self.block_manager.allocate(req, n)
        if new_blocks is None:
            return 0
        self.waiting.pop()
        out.kv_transfers = out.kv_transfers or KVTransfers()
        out.kv_transfers.swap_in += self.swap.swap_in(req.request_id, new_blocks)
        self._admit(req, req.num_computed_tokens, out)
        self._add_scheduled(out, req, n, new_blocks)
        return n

    @staticmethod
    def _must_wait(req: Request) -> bool:
        """A later sibling waits for the first one's prompt; a structured request for its grammar."""
        if req.group is not None and req.sample_index > 0 and not req.group.prompt_computed:
            return True
        return req.grammar is not None and not req.grammar.is_ready()

    def _admit(self, req: Request, num_cached: int, out: SchedulerOutput) -> None:
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.running.append(req)
        self._send_new(req, out)

    def _send_new(self, req: Request, out: SchedulerOutput) -> None:
        self._sent_to_runner.add(req.request_id)
        out.new_requests.append(NewRequestData(
            req_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            sample_index=req.sample_index,
            eos_token_ids=req.eos_token_ids,
            lora_request=req.lora_request,
            pooling=req.pooling,
            beam_temperature=req.beam.params.temperature or None if req.beam is not None else None,
        ))

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int, new_blocks: list[int],
                       drafts: list[int] = ()) -> None:
        """n tokens from num_computed_tokens on, the last len(drafts) of them proposed ones."""
        start, known = req.num_computed_tokens, n - len(drafts)
        token_ids = req.all_token_ids[start:start + known]
        token_ids += [PLACEHOLDER_TOKEN] * (known - len(token_ids))  # tokens the running step samples
        token_ids += drafts
        ends = start + known == req.num_tokens_with_pending
        samples = ends and req.pooling is None  # an embedding request pools instead
        if req.request_id in self._unsent_forks:  # a forked beam's first step: the runner gets its table
            self._unsent_forks.discard(req.request_id)
            self._send_new(req, out)
            new_blocks = self.block_manager.block_ids(req.request_id)
        out.scheduled.append(ScheduledRequest(
            req.request_id, token_ids, start, new_blocks, samples, len(drafts),
            prompt_logprob_rows=self._prompt_logprob_rows(req, start, known), pool=ends and not samples,
            cow=self.block_manager.cow.pop(req.request_id, None)))
        req.num_computed_tokens += n
        if samples:
            req.num_pending_tokens += 1
        if self.limits.max_concurrent_batches > 1:
            self._in_flight.add(req.request_id)
        # findable at once: a request admitted later in this very step may share these blocks,
        # since every layer stores the step's K/V before any of its attention reads them
        self.block_manager.register_computed_blocks(req)
        if req.group is not None and req.num_computed_tokens >= req.num_prompt_tokens:
            req.group.prompt_computed = True

    @staticmethod
    def _prompt_logprob_rows(req: Request, start: int, known: int) -> tuple[int, int] | None:
        """The chunk's positions whose logits give prompt logprobs not delivered yet: position p
        gives the logprob of prompt token p + 1 (the last prompt position samples instead)."""
        if not req.wants_prompt_logprobs:
            return None
        first = max(start, req.num_prompt_logprobs)
        end = min(start + known, req.num_prompt_tokens - 1)
        return (first, end - first) if end > first else None

    def _pick_victim(self) -> Request | None:
        """FCFS: the most recently admitted request; priority: the least important one. Never one
        in flight (a pipeline stage may still write its blocks); None if there is no other."""
        candidates = [r for r in self.running if r.request_id not in self._in_flight] if self._in_flight else self.running
        if not candidates:
            return None
        if self.limits.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def requeue(self, req_ids: Iterable[str]) -> list[str]:
        """Send running requests back to the waiting queue to be recomputed (as a preemption): the
        requests of a failed step that were not at fault. Returns the ids requeued."""
        done = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self._preempt(req, None)
                done.append(req_id)
            elif req is not None and self.swap is not None and self.swap.discard(req_id):
                req.num_computed_tokens = 0  # swapped from blocks the failed step never wrote
        return done

    def _preempt(self, req: Request, out: SchedulerOutput | None) -> int:
        """Free the request's blocks and queue it for recompute, or swap its computed blocks out
        (swap space; never a beam: its blocks are shared). A beam that already reported is parked
        instead (nothing to compute until its group selects). Returns the tokens it had been given
        earlier in this step (back to the budget); out None: outside scheduling (requeue), the next
        step's output tells the runner."""
        self.running.remove(req)
        given = 0 if out is None else sum(len(s.token_ids) for s in out.scheduled if s.req_id == req.request_id)
        # tokens whose K/V earlier steps wrote (or are writing: the copies are queued after them);
        # at least the last known token is computed again, to sample what a step in flight was sampling
        kept = min(req.num_computed_tokens - given, req.num_tokens - 1)
        if out is None or req.beam is not None or not self._swap_out(req, kept, out):
            kept = 0
        self.block_manager.free(req)
        self._unsent_forks.discard(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = kept
        req.num_pending_tokens = 0  # a token still in flight is dropped and sampled again later
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(req.request_id)
            (out.preempted_req_ids if out is not None else self._requeued_since_last_step).add(req.request_id)
        if req.beam is not None and req.beam.has_reported(req):
            req.parked = True
        else:
            self.waiting.push_front(req)
        if out is None:
            return 0
        # a request preempted in the step it was scheduled in must not stay in the output
        out.scheduled = [s for s in out.scheduled if s.req_id != req.request_id]
        out.new_requests = [n for n in out.new_requests if n.req_id != req.request_id]
        return given

    def _park_reported_beams(self, out: SchedulerOutput) -> bool:
        """Nothing could run: running beams waiting for their siblings may hold the blocks (or
        sequence slots) the waiting requests need. Park them (their candidates are kept)."""
        stuck = [r for r in self.running if r.beam is not None and r.beam.has_reported(r)]
        for req in reversed(stuck):
            self._preempt(req, out)
        return bool(stuck)

    def _swap_out(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Swap the blocks of the request's first num_tokens tokens to host memory if the swap
        space says so (mode, room, cost); the copies go into out."""
        if self.swap is None or num_tokens <= 0:
            return False
        blocks = self.block_manager.block_ids(req.request_id)[:self.block_manager.blocks_needed(num_tokens)]
        if not self.swap.should_swap(num_tokens, len(blocks)):
            return False
        out.kv_transfers = out.kv_transfers or KVTransfers()
        out.kv_transfers.swap_out += self.swap.swap_out(req.request_id, blocks)
        return True

    # ---- results of a step ----------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        logprobs = dict(zip(result.req_ids, result.logprobs)) if result.logprobs else {}
        drafts = result.draft_token_ids or {}
        prompt_lps, pooled = result.prompt_logprobs or {}, result.pooled or {}
        updates, beam_updates = [], []
        for s in sched.scheduled:
            self._in_flight.discard(s.req_id)
            req = self.requests.get(s.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted while the step ran
            plp = self._take_prompt_logprobs(req, s, prompt_lps.get(s.req_id))
            tokens = sampled.get(s.req_id)
            if tokens is None:
                self.block_manager.register_computed_blocks(req)  # blocks a prompt chunk completed
                if s.req_id in pooled:
                    req.status = RequestStatus.FINISHED_STOPPED
                    updates.append(RequestUpdate(req, [], None, True, plp, pooled[s.req_id]))
                elif plp:
                    updates.append(RequestUpdate(req, [], None, False, plp))
                continue
            if req.beam is not None:
                update = self._take_beam_step(req, logprobs.get(s.req_id))
                if update is not None:
                    beam_updates.append(update)
                continue
            if s.num_draft_tokens:
                self._take_verified(req, s.num_draft_tokens, len(tokens) - 1)
            req.num_pending_tokens -= 1
            new, finished = self._append_until_stop(req, tokens)
            # only tokens now known and computed: rejected drafts never reach a block hash
            self.block_manager.register_computed_blocks(req)
            lp = logprobs.get(s.req_id)
            updates.append(RequestUpdate(req, new, lp[:len(new)] if lp else None, finished, plp))
            # a constrained request takes no drafts: they were proposed without its grammar
            req.spec_token_ids = [] if finished or req.grammar is not None else drafts.get(s.req_id, [])
        for u in updates:
            if u.finished:
                self.running.remove(u.request)
                self._release(u.request)
        return updates + beam_updates

    @staticmethod
    def _take_prompt_logprobs(req: Request, s: ScheduledRequest,
                              plp: list[TokenLogprobs] | None) -> list[TokenLogprobs] | None:
        """Count the step's prompt logprobs as delivered (they continue the ones before: a step
        whose rows do not start there, possible only after a preemption, is dropped)."""
        if not plp or s.prompt_logprob_rows is None or s.prompt_logprob_rows[0] != req.num_prompt_logprobs:
            return None
        req.num_prompt_logprobs += len(plp)
        return plp

    # ---- beam search ----------------------------------------------------------------------
    def _take_beam_step(self, req: Request, lp: list[TokenLogprobs] | None) -> RequestUpdate | None:
        """A beam computed its last token: its candidates go to the group; when every live beam
        has reported, the group selects the next beams. Returns the group's final update."""
        req.num_pending_tokens -= 1
        self.block_manager.register_computed_blocks(req)
        assert lp, "a beam's step must return its candidates' logprobs"
        group = req.beam
        group.report(req, lp[0])
        if not group.all_reported:
            return None
        return self._advance_beam_group(group)

    def _advance_beam_group(self, group: BeamGroup) -> RequestUpdate | None:
        keep = group.select()
        parents = list(group.live)
        new_len = parents[0].num_output_tokens + 1
        if not keep or new_len >= parents[0].max_tokens or parents[0].num_tokens + 1 >= self.limits.max_model_len:
            group.finish(keep)
            self.beam_groups.pop(group.request_id, None)
            last = parents[0]
            for beam in parents:
                self._unqueue(beam)
                beam.status = RequestStatus.FINISHED_LENGTH
                self._release(beam)
            return RequestUpdate(last, [], None, True)
        # forks first (they copy their parent's tokens before the parent takes its own next token)
        chosen: dict[str, list] = {}
        for c in keep:
            chosen.setdefault(c.parent.request_id, []).append(c)
        beams: dict[int, Request] = {}
        for cands in chosen.values():
            for c in cands[1:]:
                beams[id(c)] = self._fork_beam(c.parent)
        for cands in chosen.values():
            beams[id(cands[0])] = cands[0].parent
        for c in keep:
            self._extend_beam(beams[id(c)], c.token_id)
        for beam in parents:
            if beam.request_id not in chosen:
                self._unqueue(beam)
                beam.status = RequestStatus.FINISHED_STOPPED
                self._release(beam)
        group.set_live([(beams[id(c)], c) for c in keep])
        return None

    def _fork_beam(self, parent: Request) -> Request:
        """A new beam with the parent's tokens: sharing its blocks when the parent holds them and
        a sequence slot is free, else queued to recompute (the prefix cache holds its full blocks)."""
        child = Request(parent.beam.new_beam_id(), parent.prompt_token_ids, parent.sampling_params,
                        parent.eos_token_ids, parent.arrival_time, parent.max_tokens, parent.priority,
                        output_token_ids=list(parent.output_token_ids), lora_request=parent.lora_request,
                        cache_salt=parent.cache_salt, beam=parent.beam)
        child.block_hashes = list(parent.block_hashes)
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        self.tokens_in_flight += child.num_prompt_tokens + child.max_tokens  # _release takes it back
        if parent.status == RequestStatus.RUNNING and len(self.running) < self.limits.max_num_seqs:
            child.num_computed_tokens = parent.num_computed_tokens
            self.block_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._unsent_forks.add(child.request_id)
        else:
            child.status = RequestStatus.PREEMPTED
            child.parked = True  # queued by _extend_beam
        return child

    def _extend_beam(self, beam: Request, token_id: int) -> None:
        beam.append_output_token(token_id)
        if beam.parked:  # it gave its blocks back: recompute, first in line
            beam.parked = False
            beam.status = RequestStatus.PREEMPTED
            self.waiting.push_front(beam)

    @staticmethod
    def _check_grammar(req: Request, token: int) -> bool:
        """Feeds the token to the request's grammar: refused -> error, ended -> stop."""
        if req.grammar is None:
            return False
        if not req.grammar.accept_token(token):
            req.status = RequestStatus.FINISHED_ERROR
            return True
        if req.grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _take_verified(self, req: Request, num_draft: int, num_accepted: int) -> None:
        """A verify step computed K/V for every draft; those after the first rejected one are not
        the request's tokens: num_computed_tokens steps back over them (their slots are
        overwritten later), and the acceptance is counted."""
        assert 0 <= num_accepted <= num_draft, (num_accepted, num_draft)
        req.num_computed_tokens -= num_draft - num_accepted
        self.spec_stats.observe(num_draft, num_accepted)

    def _append_until_stop(self, req: Request, tokens: list[int]) -> tuple[list[int], bool]:
        """Append the step's tokens one by one; a stop condition drops the ones after it."""
        for i, token in enumerate(tokens):
            req.append_output_token(token)
            if self._check_grammar(req, token) or self._check_stop(req, token):
                return tokens[:i + 1], True
        return tokens, False

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.limits.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
