"""The short soak (minivllm/bench/soak.py): 1,000 mixed requests through the server with client
aborts and disconnects, a KV cache that preempts constantly and injected step and request faults,
then the engine core killed under load. Nothing may be lost, no block may leak."""

from __future__ import annotations

import argparse

from minivllm.bench import soak


def test_short_soak_loses_nothing():
    p = argparse.ArgumentParser()
    soak.add_args(p)
    args = p.parse_args(["--requests", "1000", "--concurrency", "48", "--kv-blocks", "96", "--seed", "1"])
    report = soak.soak(args)
    print(dict(report.outcomes), report.rss_mb, report.kill)
    assert report.ok, report.problems
    o = report.outcomes
    assert o["lost"] == 0 and sum(o[k] for k in ("complete", "error", "abandoned")) == 1000
    assert o["complete"] > 700 and o["error"] > 0 and o["abandoned"] > 0  # the faults and aborts happened
    assert o["preemptions"] > 0
    assert report.kill["ok"], report.kill
