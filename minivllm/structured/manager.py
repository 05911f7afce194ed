"""StructuredOutputManager: the engine core's side of structured outputs.

- validate(): the backend's checks when a request is added (ValueError -> HTTP 400); a spec
  that passed them once is remembered (backend.validate_spec), so a repeated schema is not
  checked again.
- new_handle(): one GrammarHandle per sequence (n > 1: one each, sharing the compiled grammar).
  Compiles run on a thread pool, off the step loop, and are cached by GrammarKey (an LRU of
  futures), so a repeated schema, or one still compiling, costs nothing more.
- take_failed(): requests whose grammar failed to compile; the engine ends them with an error.
- bitmask(): the step's bitmask for every constrained row at once (GrammarBitmask).

The backend (xgrammar's tokenizer info: ~0.2 s for a 49k vocabulary) is built on the pool at the
first compile, so an engine that never sees a constraint never imports the library.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

from minivllm.config import StructuredOutputsConfig
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.structured.backend import (GrammarBackend, GrammarKey, GrammarMatcher, get_backend_class, grammar_key,
                                         validate_spec)
from minivllm.structured.bitmask import GrammarBitmask
from minivllm.structured.request import GrammarHandle

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (least recently used go first)


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 max_rows: int, pin_memory: bool) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's (logits' width)
        self._stop_ids = sorted(eos_token_ids)
        self._max_rows = max_rows
        self._pin = pin_memory
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()  # the backend's construction, the cache, the failed list
        self._pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2),
                                        thread_name_prefix="minivllm-grammar")
        # one thread for the step's bitmask, beside the engine thread's output processing
        # (fill_async); apart from the compile pool, so a fill never queues behind a compile
        self._fill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-grammar-fill")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._failed: deque[tuple[str, BaseException]] = deque()
        self._compiling: set[Future] = set()
        self._bitmask: Any = None  # reused host buffer [max_rows, W]
        self._start_marker, self._end_marker = (), ()
        self._reasoner = None
        if config.reasoning_parser and tokenizer is not None:
            from minivllm.reasoning import get_reasoning_parser
            self._reasoner = get_reasoning_parser(config.reasoning_parser)
            self._start_marker, self._end_marker = self._reasoner.marker_ids(tokenizer)

    # ---- requests in ------------------------------------------------------------------------
    def validate(self, params: SamplingParams) -> None:
        """ValueError naming the field if the constraint can't run (checked when added)."""
        if self._tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer (the engine was started with "
                             "skip_tokenizer_init)")
        validate_spec(self.config.backend, params.structured_outputs)

    def new_handle(self, request_id: str, so: StructuredOutputsParams, prompt_ids: list[int]) -> GrammarHandle:
        future = self._compiled(grammar_key(so))
        ended = self._reasoner is None or self._reasoner.ended_in_prompt(prompt_ids, self._start_marker,
                                                                        self._end_marker)
        handle = GrammarHandle(request_id, future, self._new_matcher, self._end_marker, ended)
        future.add_done_callback(partial(self._on_done, request_id))
        return handle

    def _compiled(self, key: GrammarKey) -> Future:
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            self._compiling.add(future)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(partial(self._forget_if_failed, key))
        return future

    def _compile(self, key: GrammarKey) -> Any:
        t = time.perf_counter()
        compiled = self._get_backend().compile(key)
        logger.debug("compiled a %s grammar in %.1f ms", key.kind, 1e3 * (time.perf_counter() - t))
        return compiled

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                cls = get_backend_class(self.config.backend)
                self._backend = cls(self._tokenizer, self._vocab_size, self._stop_ids)
            return self._backend

    def _new_matcher(self, compiled: Any) -> GrammarMatcher:
        return self._get_backend().new_matcher(compiled)

    # ---- compile results --------------------------------------------------------------------
    def _forget_if_failed(self, key: GrammarKey, future: Future) -> None:
        with self._lock:
            self._compiling.discard(future)
            if future.exception() is not None and self._cache.get(key) is future:
                del self._cache[key]  # a later request compiles it afresh

    def _on_done(self, request_id: str, future: Future) -> None:
        err = future.exception()
        if err is not None:
            with self._lock:
                self._failed.append((request_id, err))

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """(request id, error) of sequences whose grammar failed to compile, since the last call."""
        with self._lock:
            failed = list(self._failed)
            self._failed.clear()
        return failed

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Blocks until some compile finishes (or timeout_s): an idle engine waiting only for
        grammars sleeps instead of spinning."""
        with self._lock:
            pending = list(self._compiling)
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def num_compiling(self) -> int:
        with self._lock:
            return len(self._compiling)

    # ---- one step ---------------------------------------------------------------------------
    def bitmask(self, handles: list[GrammarHandle]) -> GrammarBitmask | None:
        """The bitmask of the handles whose next token is constrained (None if none is)."""
        live = [h for h in handles if h.needs_mask()]
        if not live:
            return None
        backend = self._get_backend()
        if self._bitmask is None or self._bitmask.shape[0] < len(live):
            self._bitmask = backend.allocate_bitmask(max(self._max_rows, len(live)), self._pin)
        rows = self._bitmask[:len(live)]
        backend.fill_bitmask([h.matcher for h in live], rows)
        return GrammarBitmask([h.request_id for h in live], rows)

    def fill_async(self, handles: list[GrammarHandle]) -> Future:
        """bitmask(handles) on the fill thread. xgrammar's calls release the GIL, so the caller's
        thread can work meanwhile, but it must not advance, roll back or release these handles
        until the future is done, nor call bitmask() (one host buffer serves both)."""
        return self._fill_thread.submit(self.bitmask, handles)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_thread.shutdown(wait=False, cancel_futures=True)
