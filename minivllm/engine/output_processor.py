"""Per-request output state: detokenization, stop strings, logprobs, n-sample aggregation; the
final outputs of beam search (the group's hypotheses) and of embedding requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minivllm.core.beam import BeamGroup
from minivllm.core.interfaces import TokenLogprobs
from minivllm.core.scheduler import RequestUpdate
from minivllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass
class SampleState:
    """One of the n samples of a request."""

    index: int
    detok: object | None  # IncrementalDetokenizer, None without a tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # released text (the detokenizer holds back a possible stop-string start)
    num_tokens_sent: int = 0  # for DELTA outputs
    num_text_sent: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    num_finished: int = 0  # samples with a finish_reason (kept by _finish_sample)
    kind: str = "sample"  # "sample", "beam" (beam search) or "pool" (an embedding)
    prompt_logprobs: list | None = None  # [None, {token: Logprob}, ...] as they are computed
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once
    embedding: list[float] | None = None
    kv_transfer_params: dict | None = None  # a prefill instance's answer (RequestOutput.kv_transfer_params)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by user request id
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams | BeamSearchParams | PoolingParams, child_ids: list[str],
                    arrival_time: float) -> None:
        kind = "beam" if isinstance(params, BeamSearchParams) else "pool" if isinstance(params, PoolingParams) \
            else "sample"
        if kind == "sample":
            samples = [SampleState(i, self._make_detok(prompt_ids, params),
                                   logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        else:  # text comes at the end (beams) or never (embeddings)
            samples = [SampleState(i, None) for i in range(params.n)]
        state = RequestState(request_id, prompt, prompt_ids, params, samples, RequestMetrics(arrival_time=arrival_time),
                             kind=kind)
        if kind == "sample" and params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.states[request_id] = state
        if kind != "sample":  # the request's own id stands for its beams (or is its one sequence)
            child_ids = [request_id]
        for i, cid in enumerate(child_ids):
            self.child_to_parent[cid] = (request_id, i)

    def _make_detok(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        from minivllm.engine.detokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of the requests that moved, and the child ids stopped by a stop string."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for u in updates:
            if u.request.beam is not None:  # the group's final update
                state = self.states.get(u.request.beam.request_id)
                if state is not None and not state.finished:
                    self._finish_beams(state, u.request.beam, now)
                    touched[state.request_id] = state
                continue
            parent_id, idx = self.child_to_parent[u.request.request_id]
            state = self.states[parent_id]
            sample = state.samples[idx]
            if sample.finish_reason is not None:
                continue
            if u.prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._logprob_dict(lp) for lp in u.prompt_logprobs)
            if u.pooled is not None:
                state.embedding = u.pooled
                self._first_token(state, u, now)
                self._finish_sample(state, sample, "stop", None, now)
            elif not u.new_token_ids and not u.finished:
                continue  # prompt logprobs of a prompt chunk: kept for the first output
            elif self._append(state, sample, u, now):
                stopped.append(u.request.request_id)
            touched[parent_id] = state
        return self._emit_all(touched.values()), stopped

    def _emit_all(self, states) -> list[RequestOutput]:
        # FINAL_ONLY requests (offline batches) build no output until they finish: building a
        # cumulative output for every running request every step would cost O(tokens^2)
        return [self._emit(s) for s in states
                if s.finished or s.params.output_kind != RequestOutputKind.FINAL_ONLY]

    @staticmethod
    def _first_token(state: RequestState, u: RequestUpdate, now: float) -> None:
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.first_scheduled_time = u.request.first_scheduled_time
            m.num_cached_tokens = max(u.request.num_cached_tokens, 0)
        m.last_token_time = now

    def _finish_beams(self, state: RequestState, group: BeamGroup, now: float) -> None:
        """Beam search ended: the samples become its hypotheses, best first; a final eos is left
        out of the text (as vLLM does) unless ignore_eos."""
        m = state.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        tok = self.tokenizer
        for sample, h in zip(state.samples, group.result or []):
            sample.token_ids = list(h.token_ids)
            text_ids = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
            sample.text = tok.decode(text_ids, skip_special_tokens=True) if tok is not None else ""
            sample.cumulative_logprob = h.cum_logprob
            sample.logprobs = [{t: Logprob(v, rank) for rank, (t, v) in enumerate(step.items(), 1)}
                               for step in h.logprobs]
            self._finish_sample(state, sample, h.finish_reason, None, now)
        for sample in state.samples:  # fewer hypotheses than beams (a tiny vocabulary)
            if sample.finish_reason is None:
                self._finish_sample(state, sample, "length", None, now)

    def _append(self, state: RequestState, sample: SampleState, u: RequestUpdate, now: float) -> bool:
        self._first_token(state, u, now)
        sample.token_ids.extend(u.new_token_ids)
        if u.new_logprobs and sample.logprobs is not None:
            for lp in u.new_logprobs:
                sample.logprobs.append(self._logprob_dict(lp))
                sample.cumulative_logprob += lp.logprobs[0]
        stop_str = None
        if sample.detok is not None:
            # eos / stop-token text is left out of the output, as in vLLM
            ended_on_token = u.finished and u.request.status.finish_reason == "stop"
            stop_str = sample.detok.update(u.new_token_ids, stop_terminated=ended_on_token, finished=u.finished)
        if stop_str is not None:
            self._finish_sample(state, sample, "stop", stop_str, now)
            return True
        if u.finished:
            if u.request.kv_transfer_params_out is not None:
                state.kv_transfer_params = u.request.kv_transfer_params_out
            self._finish_sample(state, sample, u.request.status.finish_reason, u.request.stop_reason, now)
        return False

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        strings = [None] * len(lp.token_ids)
        if self.tokenizer is not None:
            from minivllm.engine.detokenizer import decode_logprob_tokens
            strings = decode_logprob_tokens(self.tokenizer, lp.token_ids)
        out: dict[int, Logprob] = {}
        for rank0, (tid, val, s) in enumerate(zip(lp.token_ids, lp.logprobs, strings)):
            rank = lp.sampled_rank if rank0 == 0 else rank0
            if tid not in out:
                out[tid] = Logprob(val, rank, s)
        return out

    def _finish_sample(self, state: RequestState, sample: SampleState, reason: str, stop_reason, now: float) -> None:
        if sample.finish_reason is None:
            state.num_finished += 1
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        if state.finished:
            state.metrics.finished_time = now

    def finish_children(self, child_ids: list[str], reason: str) -> list[RequestOutput]:
        """Abort/error: end these samples now and emit the final outputs of their requests."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        for cid in child_ids:
            if cid not in self.child_to_parent:
                continue
            parent_id, idx = self.child_to_parent[cid]
            state = self.states[parent_id]
            # a beam search or an embedding ends as a whole
            samples = state.samples if state.kind != "sample" else [state.samples[idx]]
            for sample in samples:
                if sample.finish_reason is None:
                    self._finish_sample(state, sample, reason, None, now)
                    touched[parent_id] = state
        return self._emit_all(touched.values())

    def _emit(self, state: RequestState) -> RequestOutput | EmbeddingRequestOutput:
        finished = state.finished
        if finished:
            self._drop(state)
        if state.kind == "pool":
            return EmbeddingRequestOutput(state.request_id, EmbeddingOutput(state.embedding or []),
                                          state.prompt_token_ids, finished, state.prompt, state.metrics,
                                          state.metrics.num_cached_tokens)
        outs = []
        delta = state.params.output_kind == RequestOutputKind.DELTA
        for s in state.samples:
            if s.detok is not None:
                s.text += s.detok.get_next_output_text(s.finish_reason is not None, delta=True)
            outs.append(self._completion(s, delta))
        prompt_lps = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_lps = None
        if prompt_lps is not None:
            state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, finished,
                             metrics=state.metrics, prompt_logprobs=prompt_lps,
                             num_cached_tokens=state.metrics.num_cached_tokens,
                             kv_transfer_params=state.kv_transfer_params if finished else None)

    @staticmethod
    def _completion(s: SampleState, delta: bool) -> CompletionOutput:
        start, text_start = (s.num_tokens_sent, s.num_text_sent) if delta else (0, 0)
        s.num_tokens_sent, s.num_text_sent = len(s.token_ids), len(s.text)
        return CompletionOutput(
            index=s.index, text=s.text[text_start:], token_ids=s.token_ids[start:],
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=s.logprobs[start:] if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason)

    def _drop(self, state: RequestState) -> None:
        for cid in self.child_ids(state.request_id):
            self.child_to_parent.pop(cid, None)
        self.states.pop(state.request_id, None)

    def child_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of a request's sequences (a beam search: its own id, which stands for
        all its beams)."""
        state = self.states.get(request_id)
        if state is None:
            return []
        if state.kind != "sample":
            return [request_id]
        from minivllm.engine.input_processor import child_request_id
        return [child_request_id(request_id, i, state.params.n) for i in range(state.params.n)]
