"""Per-request state shared by the scheduler and the block manager (pure Python)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.core.beam import BeamGroup
    from minivllm.kv_transfer.params import RemotePrefill
    from minivllm.lora.request import LoRARequest
    from minivllm.pooling_params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # a decode instance's request whose prompt K/V is being pulled from a prefill instance
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


class GrammarState(Protocol):
    """A structured request's grammar as the scheduler sees it (the engine's
    structured.request.GrammarHandle): whether it has compiled, and its verdict on each token."""

    def is_ready(self) -> bool:
        """False while the grammar compiles: the request waits, the batch goes on without it."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the request fails)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended: the request finishes with finish_reason "stop"."""
        ...

    def release(self) -> None:
        """The request is done (finished, aborted, failed)."""
        ...


@dataclass(slots=True, eq=False)
class PromptGroup:
    """The n samples of one prompt. Later siblings wait until the first one has computed the
    prompt, then share its full KV blocks through the block hash table."""

    size: int
    prompt_computed: bool = False


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    max_tokens: int  # resolved: never None, prompt + max_tokens <= max_model_len
    priority: int = 0  # lower value = served first (vLLM's convention)
    sample_index: int = 0  # which of the n samples of its prompt
    group: PromptGroup | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or scheduled into it this step)
    # tokens sampled by a step still running on the device (async scheduling): counted, not yet known
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache (-1: not yet scheduled)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks of all_token_ids
    cache_salt: str | None = None  # tenant key: only requests with the same salt share cached blocks
    first_scheduled_time: float | None = None
    # speculative decoding: tokens proposed for the next step (never part of all_token_ids, never
    # hashed); dropped on preemption
    spec_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured outputs only; kept across preemption
    # prompt logprobs: prompt positions whose logits were delivered (positions 0 .. n-1 give the
    # logprobs of prompt tokens 1 .. n); only sample 0 of a request computes them
    num_prompt_logprobs: int = 0
    pooling: PoolingParams | None = None  # an embedding request: pooled hidden states, no tokens
    lora_request: LoRARequest | None = None
    beam: BeamGroup | None = None  # the beam-search group this sequence is a beam of
    # a beam that reported its candidates and then gave its KV blocks back (preempted while it
    # waited for its siblings): it is in neither queue until the group selects the next beams
    parked: bool = False
    # disaggregated prefill/decode (kv_transfer/): a producer's request keeps its blocks after it
    # finishes until a consumer pulled them (remote_decode), and says where they are
    # (kv_transfer_params_out); a consumer's request pulls its prompt's K/V first (remote_prefill,
    # None once pulled or given up), then computes its last prompt token (remote_kv_loaded)
    remote_decode: bool = False
    kv_transfer_params_out: dict | None = None
    remote_prefill: RemotePrefill | None = None
    remote_kv_loaded: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None and self.sample_index == 0

    @property
    def max_cached_prefix(self) -> int | None:
        """Leading tokens the prefix cache may serve (None: any). A prompt-logprobs request needs
        the logits of every prompt position it has not delivered yet; mean pooling needs the hidden
        state of every token."""
        if self.pooling is not None and self.pooling.pooling_type == "MEAN":
            return 0
        if self.wants_prompt_logprobs:
            return self.num_prompt_logprobs
        return None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
