"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

Each app gets its own CollectorRegistry (no global state: tests run several servers in one
process). Two sources:
- per-request histograms and the request_success counter, fed by an observer that runs on the
  engine thread after every step (so requests whose clients left are counted too);
- engine totals and gauges (running, waiting, KV usage, prefix cache, preemptions, tokens),
  read from the engine's stats snapshot when /metrics is scraped (swap and offload counters
  included, `vllm:num_blocks_swapped_out_total`, `vllm:kv_offload_hits_total`, ...); for MoE models also
  `minivllm:moe_expert_tokens_total{expert}` (vLLM has no such family): tokens routed to each
  expert, summed over the layers, so load imbalance shows (refreshed about once a second);
  with disaggregated prefill/decode `minivllm:kv_pulled_blocks_total`, `minivllm:kv_pull_failures_total`
  (prompts recomputed) and the gauge `minivllm:kv_held_requests`.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from minivllm.engine.async_engine import AsyncEngine
from minivllm.outputs import RequestOutput
from minivllm.server.live_stats import RecentLatencies

# vLLM's buckets
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0]


def _1_2_5_buckets(limit: int) -> list[float]:
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return out
            out.append(float(v))
        exp += 1


@dataclass(slots=True)
class _Progress:
    num_tokens: int = 0
    last_token_time: float | None = None
    first_seen: bool = False


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._progress: dict[str, _Progress] = {}  # engine thread only
        self.recent = RecentLatencies()  # the same latencies per second, for the dashboard and /load
        self._make_request_metrics(engine.max_model_len)
        self.registry.register(_EngineStatsCollector(engine, model_name))
        engine.add_output_observer(self.observe)

    def _make_request_metrics(self, max_model_len: int) -> None:
        reg, lbl, name = self.registry, ["model_name"], self.model_name

        def hist(metric: str, doc: str, buckets: list[float]):
            return Histogram(metric, doc, lbl, buckets=buckets, registry=reg).labels(name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT)
        # observed for every running request at every step: a plain bucket array, exposed under
        # both names (prometheus_client's Histogram.observe cost ~6 us; 1,000 streams x 20 steps/s)
        self.itl = _FastHistogram(_ITL)
        reg.register(_FastHistogramCollector(self.itl, name, [
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (deprecated "
             "alias of vllm:inter_token_latency_seconds).")]))
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                        _LATENCY)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          _LATENCY)
        tokens = _1_2_5_buckets(max_model_len)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=reg)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        self.engine.remove_output_observer(self.observe)

    # ---- engine thread -----------------------------------------------------------------------
    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            if not isinstance(out, RequestOutput):  # an embedding: no tokens, one finished output
                if out.finished:
                    self.req_prompt.observe(len(out.prompt_token_ids))
                    self.success.labels(self.model_name, "stop").inc()
                continue
            p = self._progress.setdefault(out.request_id, _Progress())
            n = sum(len(o.token_ids) for o in out.outputs)
            if n > p.num_tokens:
                m = out.metrics
                if p.last_token_time is None and m is not None and m.first_token_time is not None:
                    ttft = max(m.first_token_time - m.arrival_time, 0.0)
                    self.ttft.observe(ttft)
                    self.recent.add_ttft(now, ttft)
                elif p.last_token_time is not None:
                    self.itl.observe(now - p.last_token_time)
                    self.recent.add_itl(now, now - p.last_token_time)
                p.num_tokens, p.last_token_time = n, now
            if out.finished:
                self._finish(out, now)

    def _finish(self, out: RequestOutput, now: float) -> None:
        self._progress.pop(out.request_id, None)
        self.recent.add_finished(now)
        m = out.metrics
        if m is not None:
            self.e2e.observe(max((m.finished_time or now) - m.arrival_time, 0.0))
            if m.first_scheduled_time is not None:
                self.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
        self.req_prompt.observe(len(out.prompt_token_ids))
        for o in out.outputs:  # one count per sample, as vLLM counts each of the n child requests
            self.req_gen.observe(len(o.token_ids))
            self.success.labels(self.model_name, o.finish_reason or "abort").inc()


class _FastHistogram:
    """A histogram's state (per-bucket counts, total, sum) updated with one bisect and a lock."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = list(bounds)
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # first bound >= value: "le" semantics
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets [(le, count)], ending with +Inf, and the sum."""
        with self._lock:
            counts, total_sum = list(self._counts), self._sum
        buckets, running = [], 0
        for bound, c in zip([*map(floatToGoString, self.bounds), "+Inf"], counts):
            running += c
            buckets.append((bound, running))
        return buckets, total_sum


class _FastHistogramCollector:
    def __init__(self, hist: _FastHistogram, model_name: str, names: list[tuple[str, str]]) -> None:
        self.hist, self.model_name, self.names = hist, model_name, names

    def collect(self):
        buckets, total_sum = self.hist.snapshot()
        for metric, doc in self.names:
            h = HistogramMetricFamily(metric, doc, labels=["model_name"])
            h.add_metric([self.model_name], buckets, total_sum)
            yield h


class _EngineStatsCollector:
    """Engine-wide totals as counters, and gauges, from the latest stats snapshot."""

    _COUNTERS = [("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in tokens."),
                 ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in tokens."),
                 ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
                 ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
                 ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
                 ("vllm:spec_decode_num_drafts", "spec_num_drafts", "Number of spec decoding drafts."),
                 ("vllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
                 ("vllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Number of accepted tokens."),
                 # KV in host memory (kv_transfer/): swap preemption and the prefix cache's offload tier
                 ("vllm:num_blocks_swapped_out", "num_blocks_swapped_out", "KV blocks swapped out to host memory."),
                 ("vllm:num_blocks_swapped_in", "num_blocks_swapped_in", "KV blocks swapped in from host memory."),
                 ("vllm:kv_offload_hits", "offload_hit_blocks",
                  "KV blocks of prefix-cache hits loaded back from the CPU offload tier."),
                 ("vllm:kv_offload_stores", "offload_stored_blocks",
                  "KV blocks evicted from the device prefix cache and kept in the CPU offload tier."),
                 ("vllm:kv_transfer_bytes", "kv_transfer_bytes",
                  "Bytes of KV blocks copied between the device and host memory."),
                 # disaggregated prefill/decode (kv_transfer/connector.py)
                 ("minivllm:kv_pulled_blocks", "kv_pulled_blocks", "KV blocks pulled from prefill instances."),
                 ("minivllm:kv_pull_failures", "kv_pull_failures",
                  "Pulls from prefill instances given up: the prompt was recomputed here.")]
    _GAUGES = [("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
               ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
               ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
               ("vllm:num_requests_swapped", "num_swapped", "Number of requests swapped to CPU."),
               ("minivllm:kv_held_requests", "kv_held_requests",
                "Finished requests whose KV blocks wait for a decode instance to pull them.")]

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.get_stats()
        # data parallelism: one sample per replica, labelled engine="<replica index>" (vLLM's label)
        each = [([self.model_name, str(i)], r) for i, r in enumerate(getattr(stats, "replicas", ()))]
        labels, samples = (["model_name", "engine"], each) if each else (["model_name"], [([self.model_name], stats)])
        for family, table in ((CounterMetricFamily, self._COUNTERS), (GaugeMetricFamily, self._GAUGES)):
            for metric, attr, doc in table:
                m = family(metric, doc, labels=labels)
                for values, st in samples:
                    m.add_metric(values, float(getattr(st, attr)))
                yield m
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], float(n))
        yield per_pos
        counts = getattr(stats, "expert_token_counts", None)
        if counts is not None:
            c = CounterMetricFamily("minivllm:moe_expert_tokens", "Tokens routed to each expert, summed over "
                                    "the MoE layers (one per token, layer and selected expert).",
                                    labels=["model_name", "expert"])
            for expert, n in enumerate(counts):
                c.add_metric([self.model_name, str(expert)], float(n))
            yield c
