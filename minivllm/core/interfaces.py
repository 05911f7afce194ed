"""Plain data that crosses the scheduler/runner boundary, both ways (no torch, no live objects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.lora.request import LoRARequest
    from minivllm.pooling_params import PoolingParams

# Stands for a token sampled by the step still running on the device (async scheduling): the
# runner fills it in on the device from that step's sampled ids.
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class NewRequestData:
    """A request entering the runner: first schedule, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    sample_index: int
    eos_token_ids: frozenset[int]
    lora_request: LoRARequest | None = None  # the adapter the request runs with (None: base model)
    pooling: PoolingParams | None = None  # an embedding request: the pooled hidden state, no sampling
    # beam search: candidates are ranked by log_softmax(logits / beam_temperature) (None: the logits)
    beam_temperature: float | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions
    num_computed_tokens .. num_computed_tokens + len(token_ids) - 1. The last id may be
    PLACEHOLDER_TOKEN: the token the previous step is sampling."""

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int  # before this step
    new_block_ids: list[int]  # appended to the request's block table this step
    samples: bool  # the chunk reaches the last known token, so this step yields a new token
    # speculative decoding: the last num_draft_tokens of token_ids are proposed tokens to verify
    # (the step then yields 1 to num_draft_tokens + 1 tokens)
    num_draft_tokens: int = 0
    # prompt logprobs: (first position, count) of this chunk's positions whose logits give the
    # logprobs of the prompt tokens after them; None: none this step
    prompt_logprob_rows: tuple[int, int] | None = None
    pool: bool = False  # an embedding request's last prompt chunk: the step returns its pooled vector
    # copy-on-write before this step writes: (table index, source block, new block). The block at
    # that index was shared (a forked beam) and partly filled: the runner copies the source's K/V
    # into the new block and puts it in the table before the forward pass
    cow: tuple[int, int, int] | None = None


BlockPairs = list[tuple[int, int]]  # (source block id, destination block id)


@dataclass
class KVTransfers:
    """Block copies between the device KV pool and the host pools (kv_transfer/), made by the
    runner before the step's forward: every copy to the host first, then every copy to the device
    (a device block whose content leaves this step may be the destination of one that comes in;
    the scheduler never reuses in one step a host block that a copy of that step still reads)."""

    swap_out: BlockPairs = field(default_factory=list)  # device -> swap pool (preemption by swapping)
    offload: BlockPairs = field(default_factory=list)  # device -> offload pool (evicted prefix blocks)
    swap_in: BlockPairs = field(default_factory=list)  # swap pool -> device (a swapped request resumes)
    load: BlockPairs = field(default_factory=list)  # offload pool -> device (a prefix hit in host memory)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.offload or self.swap_in or self.load)


@dataclass
class KVPull:
    """A consumer's pull (disaggregated prefill/decode): the producer's blocks `remote_block_ids`
    of request `remote.request_id` into this engine's blocks `local_block_ids` (same order; may be
    empty: the producer only releases its blocks)."""

    req_id: str
    remote: object  # kv_transfer.params.RemotePrefill
    local_block_ids: list[int]
    remote_block_ids: list[int]


@dataclass
class KVSend:
    """A producer's finished request whose blocks wait for a consumer to pull them."""

    req_id: str
    block_ids: list[int]


@dataclass
class KVJobs:
    """What the scheduler asks of the KV connector since it was last asked (the engine hands it
    over before each step's connector poll)."""

    sends: list[KVSend] = field(default_factory=list)
    pulls: list[KVPull] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # pulls of aborted requests: never apply them

    def __bool__(self) -> bool:
        return bool(self.sends or self.pulls or self.cancels)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)  # dropped too; re-sent as new later
    num_scheduled_tokens: int = 0
    kv_transfers: KVTransfers | None = None  # block copies to make before the forward (None: none)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def __reduce__(self):
        """Pickled as columns (the mp and Ray executors send one every step): 256 decoding
        requests as 256 ScheduledRequest objects cost ~1 ms to pickle and unpickle on the
        host, in series with every step (docs/perf.md, the multi-GPU run on 4 H200s); as a
        few lists of ints and strings, a fraction of that."""
        return (_unpack_scheduler_output, (self.new_requests, _pack_scheduled(self.scheduled), self.finished_req_ids,
                                           self.preempted_req_ids, self.num_scheduled_tokens, self.kv_transfers))


def _pack_scheduled(scheduled: list[ScheduledRequest]) -> tuple:
    """(ids, token counts, all tokens end to end, num_computed_tokens, new block counts, all new
    blocks end to end, samples flags, rare fields) where rare fields holds (index,
    num_draft_tokens, prompt_logprob_rows, pool, cow) of only the requests that set any of them."""
    tokens, blocks = [], []
    for s in scheduled:
        tokens += s.token_ids
        blocks += s.new_block_ids
    rare = [(i, s.num_draft_tokens, s.prompt_logprob_rows, s.pool, s.cow) for i, s in enumerate(scheduled)
            if s.num_draft_tokens or s.prompt_logprob_rows is not None or s.pool or s.cow is not None]
    return ([s.req_id for s in scheduled], [len(s.token_ids) for s in scheduled], tokens,
            [s.num_computed_tokens for s in scheduled], [len(s.new_block_ids) for s in scheduled], blocks,
            [s.samples for s in scheduled], rare)


def _unpack_scheduled(packed: tuple) -> list[ScheduledRequest]:
    ids, token_counts, tokens, computed, block_counts, blocks, samples, rare = packed
    out, t, b = [], 0, 0
    for rid, nt, start, nb, smp in zip(ids, token_counts, computed, block_counts, samples):
        out.append(ScheduledRequest(rid, tokens[t:t + nt], start, blocks[b:b + nb], smp))
        t += nt
        b += nb
    for i, drafts, rows, pool, cow in rare:
        s = out[i]
        s.num_draft_tokens, s.prompt_logprob_rows, s.pool, s.cow = drafts, rows, pool, cow
    return out


def _unpack_scheduler_output(new_requests, packed, finished, preempted, num_tokens, kv_transfers) -> SchedulerOutput:
    return SchedulerOutput(new_requests, _unpack_scheduled(packed), finished, preempted, num_tokens, kv_transfers)


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: column 0 is the sampled token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1 = most likely


class RequestFault(Exception):
    """A step failed because of these requests alone (their own input or state, e.g. a grammar
    that breaks at run time): they end with finish_reason "error", the step's other requests
    are recomputed, and the engine goes on serving."""

    def __init__(self, req_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.req_ids = list(req_ids)


@dataclass
class RunnerOutput:
    req_ids: list[str]  # requests that sampled this step, in order
    # per request the tokens it gained: one, or with speculative decoding the accepted drafts
    # and one more (1 .. num_draft_tokens + 1)
    sampled_token_ids: list[list[int]]
    # aligned with req_ids when any request asked: one TokenLogprobs per token gained (or None)
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # speculative decoding: tokens proposed for each request's next step
    draft_token_ids: dict[str, list[int]] | None = None
    # prompt logprobs of the step's prompt_logprob_rows, by request: one TokenLogprobs per row, in
    # position order (column 0 the prompt token that follows the row, then the top-k)
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    # embedding requests whose prompt completed this step: the pooled (and normalized) vector
    pooled: dict[str, list[float]] | None = None
    # a MoE model's tokens per expert [MoE layers][experts] since startup, when newly read (about
    # once a second: runner/expert_counts.py); how a worker rank's counts reach the engine
    expert_token_counts: list[list[int]] | None = None
