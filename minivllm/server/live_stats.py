"""Latencies over the last minutes, per one-second bin, for the dashboard and /load.

Fed by ServerMetrics' output observer (the same place that fills the Prometheus histograms), so
every request is counted once. A bin keeps at most MAX_SAMPLES TTFT and ITL samples (the ones
past that replace random earlier ones: a reservoir), so a busy second costs bounded memory;
bins older than WINDOW_S are dropped.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 300  # the dashboard's charts show the last five minutes
MAX_SAMPLES = 256  # per bin and kind


@dataclass(slots=True)
class _Bin:
    second: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    num_ttft: int = 0  # samples offered (the lists hold a reservoir of them)
    num_itl: int = 0
    finished: int = 0


def _keep(samples: list[float], seen: int, value: float, rng: random.Random) -> None:
    """Reservoir sampling: after `seen` offers, each is kept with probability MAX_SAMPLES / seen."""
    if len(samples) < MAX_SAMPLES:
        samples.append(value)
    else:
        j = rng.randrange(seen)
        if j < MAX_SAMPLES:
            samples[j] = value


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class RecentLatencies:
    def __init__(self, window_s: int = WINDOW_S) -> None:
        self.window_s = window_s
        self._bins: deque[_Bin] = deque()
        self._lock = threading.Lock()
        self._rng = random.Random(0)

    def _bin(self, now: float) -> _Bin:
        sec = int(now)
        if not self._bins or self._bins[-1].second != sec:
            self._bins.append(_Bin(sec))
            while self._bins[0].second <= sec - self.window_s:
                self._bins.popleft()
        return self._bins[-1]

    def add_ttft(self, now: float, value: float) -> None:
        with self._lock:
            b = self._bin(now)
            b.num_ttft += 1
            _keep(b.ttft, b.num_ttft, value, self._rng)

    def add_itl(self, now: float, value: float) -> None:
        with self._lock:
            b = self._bin(now)
            b.num_itl += 1
            _keep(b.itl, b.num_itl, value, self._rng)

    def add_finished(self, now: float) -> None:
        with self._lock:
            self._bin(now).finished += 1

    def series(self, since_s: float = 0.0) -> list[dict]:
        """One point per second that saw something: t, TTFT and ITL p50/p99 (s), finished."""
        with self._lock:
            bins = [(b.second, list(b.ttft), list(b.itl), b.finished) for b in self._bins if b.second >= since_s]
        return [{"t": sec, "ttft_p50": percentile(tt, 0.5), "ttft_p99": percentile(tt, 0.99),
                 "itl_p50": percentile(it, 0.5), "itl_p99": percentile(it, 0.99), "finished": fin}
                for sec, tt, it, fin in bins]

    def finished_rate(self, now: float, window_s: float = 10.0) -> float:
        """Requests finished per second over the last window_s seconds."""
        with self._lock:
            n = sum(b.finished for b in self._bins if b.second > now - window_s)
        return n / window_s
