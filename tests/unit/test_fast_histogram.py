"""The inter-token-latency histogram (observed for every stream at every step) is a plain
bucket array; its exposition must equal prometheus_client's Histogram on the same values."""

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from minivllm.server.metrics import _ITL, _FastHistogram, _FastHistogramCollector


def test_fast_histogram_exposes_what_prometheus_client_would():
    fast = _FastHistogram(_ITL)
    ours, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours.register(_FastHistogramCollector(fast, "m", [("vllm:inter_token_latency_seconds", "doc")]))
    ref = Histogram("vllm:inter_token_latency_seconds", "doc", ["model_name"], buckets=_ITL,
                    registry=ref_reg).labels("m")
    rng = random.Random(0)
    values = [rng.choice(_ITL) for _ in range(200)] + [rng.expovariate(10.0) for _ in range(2000)] + [0.0, 1e6]
    for v in values:  # bucket bounds themselves included: "le" means <=
        fast.observe(v)
        ref.observe(v)
    want = [line for line in generate_latest(ref_reg).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == want
