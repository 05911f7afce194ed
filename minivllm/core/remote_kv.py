"""The scheduler's share of disaggregated prefill/decode (kv_transfer/; pure Python).

Producer (prefill instance): a request with remote_decode that finishes normally keeps its KV
blocks (pinned: not freed, so never evicted or rewritten) in `sending` until the connector says a
consumer pulled them or the send timed out; its output carries where they are
(kv_transfer_params_out).

Consumer (decode instance): a request with remote_prefill takes its local prefix-cache hit, gets
blocks for the rest of its prompt but the last token and waits in `pulling` (status
WAITING_FOR_REMOTE_KVS: in no queue, no sequence slot, no token budget) while others run. Pulled,
it goes back to the front of the queue with every prompt token but the last counted as computed;
its first step computes that token, which samples the first output token (greedy: the same token
as a single instance). A pull that fails, or K/V that cannot fit the request (another prompt,
block size, prompt logprobs wanted), makes it compute the whole prompt here (num_kv_pull_failures).
An abort mid-pull frees the blocks at once and cancels the pull (the connector applies pulls only
in its poll, which the cancel reaches first).

The engine moves `kv_jobs` to the connector and the connector's news back (finish_kv_transfers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from minivllm.core.interfaces import KVJobs, KVPull, KVSend, SchedulerOutput
from minivllm.core.request import Request, RequestStatus
from minivllm.kv_transfer.params import producer_answer, prompt_hash

logger = logging.getLogger(__name__)


class RemoteKVScheduling:
    """Mixed into Scheduler (it uses the scheduler's block_manager, waiting queue and step helpers)."""

    def _init_remote_kv(self) -> None:
        # this producer's (engine id, host, port), set by the engine once its connector listens
        # (None: not a producer)
        self.kv_address: tuple[str, str, int] | None = None
        self.kv_jobs = KVJobs()  # for the connector, taken by the engine before each step
        self.sending: dict[str, Request] = {}  # finished producer requests holding blocks for a pull
        self.pulling: dict[str, Request] = {}  # consumer requests whose prompt K/V is being pulled
        self._pull_sizes: dict[str, int] = {}  # their pulls' block counts
        self.num_kv_pulled_blocks = 0  # blocks of pulls that arrived
        self.num_kv_pull_failures = 0  # pulls given up: the prompt was recomputed here

    def _cancel_pull(self, req: Request) -> None:
        """An abort while the request waits for its pull (its blocks are freed by the caller)."""
        self.pulling.pop(req.request_id, None)
        self._pull_sizes.pop(req.request_id, None)
        self.kv_jobs.cancels.append(req.request_id)

    def _hold_for_remote_decode(self, req: Request) -> bool:
        """A producer's request that finished normally keeps its blocks (pinned: not freed, so
        never evicted or rewritten) until the connector says a consumer pulled them or the send
        timed out; its output says where they are."""
        if not req.remote_decode or self.kv_address is None or req.status not in (
                RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            return False
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
            req, size = self.pulling.pop(req_id, None), self._pull_sizes.pop(req_id, 0)
            if req is None:
                continue  # aborted meanwhile (its blocks are already free)
            req.status = RequestStatus.WAITING
            if ok:
                self.num_kv_pulled_blocks += size
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
            logger.warning("request %s: recomputing its prompt, the remote K/V cannot be used: %s",
                           req.request_id, why)
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
        self._pull_sizes[req.request_id] = len(local)
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
