"""Per-request output state: detokenization, stop strings, logprobs, n-sample aggregation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minivllm.core.interfaces import TokenLogprobs
from minivllm.core.request import Request
from minivllm.core.scheduler import RequestUpdate
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


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

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by user request id
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    child_ids: list[str], arrival_time: float) -> None:
        samples = [SampleState(i, self._make_detok(prompt_ids, params),
                               logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.states[request_id] = RequestState(request_id, prompt, prompt_ids, params, samples,
                                               RequestMetrics(arrival_time=arrival_time))
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
            parent_id, idx = self.child_to_parent[u.request.request_id]
            state = self.states[parent_id]
            sample = state.samples[idx]
            if sample.finish_reason is not None:
                continue
            if self._append(state, sample, u, now):
                stopped.append(u.request.request_id)
            touched[parent_id] = state
        return self._emit_all(touched.values()), stopped

    def _emit_all(self, states) -> list[RequestOutput]:
        # FINAL_ONLY requests (offline batches) build no output until they finish: building a
        # cumulative output for every running request every step would cost O(tokens^2)
        return [self._emit(s) for s in states
                if s.finished or s.params.output_kind != RequestOutputKind.FINAL_ONLY]

    def _append(self, state: RequestState, sample: SampleState, u: RequestUpdate, now: float) -> bool:
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.first_scheduled_time = u.request.first_scheduled_time
            m.num_cached_tokens = max(u.request.num_cached_tokens, 0)
        m.last_token_time = now
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
            if state.samples[idx].finish_reason is None:
                self._finish_sample(state, state.samples[idx], reason, None, now)
                touched[parent_id] = state
        return self._emit_all(touched.values())

    def _emit(self, state: RequestState) -> RequestOutput:
        finished = state.finished
        outs = []
        delta = state.params.output_kind == RequestOutputKind.DELTA
        for s in state.samples:
            if s.detok is not None:
                s.text += s.detok.get_next_output_text(s.finish_reason is not None, delta=True)
            outs.append(self._completion(s, delta))
        if finished:
            self._drop(state)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, finished,
                             metrics=state.metrics, num_cached_tokens=state.metrics.num_cached_tokens)

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
        state = self.states.get(request_id)
        if state is None:
            return []
        from minivllm.engine.input_processor import child_request_id
        return [child_request_id(request_id, i, state.params.n) for i in range(state.params.n)]
