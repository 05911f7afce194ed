"""bench tune's pieces without servers: SLO parsing, the SLO check, goodput per request, the best row."""

from __future__ import annotations

import math

import pytest

from minivllm.bench.tune import _rates, best_row, parse_slo, slo_met
from minivllm.server.bench_serve import RequestResult, meets_goodput, parse_goodput


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft_p99=500ms,itl_p99=50ms") == {"ttft": (99.0, 0.5), "itl": (99.0, 0.05)}
    assert parse_slo("e2el_p90=2s, tpot_p50=800us") == {"e2el": (90.0, 2.0), "tpot": (50.0, pytest.approx(0.0008))}
    assert parse_slo("ttft_p99.9=100") == {"ttft": (99.9, 0.1)}  # no unit: milliseconds
    for bad in ("", "ttft=500ms", "latency_p99=1s", "ttft_p99=fast", "ttft_p99=0ms", "ttft_p120=1s"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo(bad)
    assert _rates("2,inf") == [2.0, math.inf]


def _figures(ttft_p99: float, itl_p99: float, failed: int = 0) -> dict:
    return {"requests_failed": failed, "ttft_ms": {"p99": ttft_p99}, "itl_ms": {"p99": itl_p99}}


def test_slo_met_checks_every_named_percentile_and_failures():
    slo = parse_slo("ttft_p99=500ms,itl_p99=50ms")
    assert slo_met(_figures(499.0, 50.0), slo)
    assert not slo_met(_figures(501.0, 10.0), slo)
    assert not slo_met(_figures(100.0, 51.0), slo)
    assert not slo_met(_figures(100.0, 10.0, failed=1), slo)


def test_goodput_per_request():
    targets = parse_goodput(["ttft:500", "itl:50"])
    assert targets == {"ttft": 0.5, "itl": 0.05}
    fast = RequestResult(ok=True, ttft=0.2, itl=[0.01] * 200 + [0.2], e2e=2.0, output_tokens=202)
    assert meets_goodput(fast, targets)  # one slow gap in 201 is past the p99
    slow_gaps = RequestResult(ok=True, ttft=0.2, itl=[0.01] * 10 + [0.2] * 5, e2e=2.0, output_tokens=16)
    assert not meets_goodput(slow_gaps, targets)
    assert not meets_goodput(RequestResult(ok=True, ttft=0.6, itl=[0.01], e2e=1.0, output_tokens=2), targets)
    for bad in (["ttft"], ["latency:5"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_best_row_is_the_most_goodput_that_meets_the_slo():
    rows = [{"max_num_seqs": 8, "max_num_batched_tokens": 512, "meets_slo": True, "goodput_per_s": 3.0},
            {"max_num_seqs": 16, "max_num_batched_tokens": 512, "meets_slo": False, "goodput_per_s": 9.0},
            {"max_num_seqs": 4, "max_num_batched_tokens": 512, "meets_slo": True, "goodput_per_s": 3.0},
            {"max_num_seqs": 32, "max_num_batched_tokens": 512, "meets_slo": True, "goodput_per_s": 2.0}]
    assert best_row(rows)["max_num_seqs"] == 4  # tie at 3.0: the fewer sequences
    assert best_row([r for r in rows if not r["meets_slo"]]) is None
