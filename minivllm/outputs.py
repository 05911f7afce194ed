"""What the engine returns for each request (mirrors vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob (the sampled token and the top-k ones)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" once finished
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative state of one request: each streamed output holds all text and tokens so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # disaggregated prefill/decode: a prefill instance's answer (where the prompt's K/V blocks
    # wait for the decode instance), on the finished output; None otherwise
    kv_transfer_params: dict | None = None


# one dict per prompt token: None for the first (nothing predicts it), then the prompt token and the
# top-k (SamplingParams.prompt_logprobs)
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of an embedding request (LLM.embed, /v1/embeddings): mirrors vLLM's."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """One result of beam search (vLLM's): tokens = prompt + generated, the per-step candidate
    logprobs of each generated token, cum_logprob, the generated text (a final eos left out)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]
