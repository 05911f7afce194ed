"""Multi-model serve (server/multi_model.py): /load and the dashboard per model, by ?model=."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.integration.test_multi_model import two_models  # noqa: F401 - the fixture: alpha and beta behind one router


def test_per_model_load_and_dashboard(two_models):
    """GET /load and the dashboard's events pick the model by ?model= (default: the first)."""
    base_url, engines = two_models
    with httpx.Client(base_url=base_url, timeout=60) as client:
        engines[1].pause()  # beta's request waits; alpha stays idle
        body = {"model": "beta", "prompt": "Hi", "max_tokens": 4}
        sender = threading.Thread(target=lambda: httpx.post(base_url + "/v1/completions", json=body, timeout=300))
        sender.start()
        try:
            deadline = time.monotonic() + 60
            while client.get("/load?model=beta").json()["num_requests_waiting"] != 1:
                assert time.monotonic() < deadline, "beta's request never showed on its /load"
                time.sleep(0.05)
            assert client.get("/load?model=alpha").json()["num_requests_waiting"] == 0
            assert client.get("/load").json()["num_requests_waiting"] == 0  # the first model's
        finally:
            engines[1].resume()
            sender.join(300)
        assert client.get("/load?model=gamma").status_code == 404
        with client.stream("GET", "/dashboard/events?model=beta") as r:
            line = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
        event = json.loads(line[6:])
        assert event["models"] == ["beta"] and event["all_models"] == ["alpha", "beta"]
