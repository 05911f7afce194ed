"""engine/profiler.critical_path: where a step's device time goes when kernels overlap (PDL)."""

import json

import pytest

from minivllm.engine.profiler import critical_path, device_events


def test_overlapping_kernels_are_charged_only_past_the_frontier():
    # a: 0-10; b starts early (PDL) at 8 and ends 15: 5 exclusive; gap 15-17 idle; c 17-20;
    # d inside c (17.5-19): 0 exclusive but one call
    events = [(0.0, 10.0, "a"), (8.0, 15.0, "b"), (17.0, 20.0, "c"), (17.5, 19.0, "d")]
    out = critical_path(events)
    by = {r["kernel"]: r for r in out["kernels"]}
    assert by["a"]["ms"] == pytest.approx(0.010)
    assert by["b"]["ms"] == pytest.approx(0.005)
    assert by["c"]["ms"] == pytest.approx(0.003)
    assert by["d"]["ms"] == 0.0 and by["d"]["calls"] == 1
    assert out["idle_ms"] == pytest.approx(0.002)
    assert out["span_ms"] == pytest.approx(0.020)
    assert sum(r["ms"] for r in out["kernels"]) + out["idle_ms"] == pytest.approx(out["span_ms"])
    assert [r["kernel"] for r in out["kernels"]][:2] == ["a", "b"]
    assert out["idle_between"] == [{"after": "b", "before": "c", "ms": 0.002, "count": 1}]


def test_repeated_names_add_up_and_empty_is_zero():
    out = critical_path([(0.0, 2.0, "k"), (2.0, 5.0, "k"), (6.0, 7.0, "k")])
    assert out["kernels"] == [{"kernel": "k", "ms": 0.006, "calls": 3, "share": round(6 / 7, 4)}]
    assert critical_path([]) == {"span_ms": 0.0, "idle_ms": 0.0, "kernels": [], "idle_between": []}


def test_device_events_reads_kernels_copies_and_sets_in_start_order(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 50, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 10, "dur": 2},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 20, "dur": 1},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert device_events(str(path)) == [(10.0, 12.0, "Memcpy HtoD"), (20.0, 21.0, "Memset"), (50.0, 55.0, "late")]
