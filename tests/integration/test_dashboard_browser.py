"""A real browser on the live dashboard: headless Chromium (Debian's `chromium`, driven by
playwright with executable_path set; .ci/run installs both) opens /dashboard of a server under
load and checks that the counts, the charts and the KV block map render and change; then opens
a run's HTML timeline. Screenshots go to test-output/ (the CI artifacts)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (.ci/run installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run: apt-get install -y chromium)")

OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "test-output")
KEY = "sk-browser"
CANVASES = ["queue-chart", "split-chart", "batch-chart", "kv-map", "tput-chart", "kv-chart"]


@pytest.fixture(scope="module")
def loaded_server():
    """A server with requests arriving all the time (a new one whenever one ends)."""
    from minivllm.engine.async_engine import AsyncEngine
    engine = AsyncEngine.from_kwargs(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=16 << 20,
                                     max_num_seqs=6)
    stop = threading.Event()
    with ServerThread(create_app(engine, ServerSettings(api_key=KEY, dashboard_interval_s=0.25))) as srv:
        def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                body = {"prompt": [200 + i + n] * (30 + 20 * i), "max_tokens": 24 + 8 * i, "ignore_eos": True}
                httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120,
                           headers={"Authorization": f"Bearer {KEY}"})
                n += 1
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        yield engine, srv.base_url
        stop.set()
        for t in threads:
            t.join(120)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _canvas_pixels(page) -> dict[str, str]:
    """Each chart's pixels (as a data URL) when it has drawn something other than the background."""
    return page.evaluate("""(ids) => Object.fromEntries(ids.map(id => {
        const c = document.getElementById(id), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let inked = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) inked++;
        return [id, inked > 50 ? c.toDataURL() : ''];
    }))""", CANVASES)


def _updates(page) -> int:
    return int(page.evaluate("document.body.dataset.updates || 0"))


def test_dashboard_renders_and_changes_under_load(loaded_server, browser):
    _, base = loaded_server
    os.makedirs(OUT_DIR, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base + f"/dashboard?api_key={KEY}")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 3", timeout=120_000)
    # wait until requests hold blocks in the map and the batch is drawn
    page.wait_for_function("document.getElementById('kv-caption').textContent.includes('requests hold')",
                           timeout=120_000)
    first, n1 = _canvas_pixels(page), _updates(page)
    assert all(first[c] for c in CANVASES), f"blank charts: {[c for c in CANVASES if not first[c]]}"
    assert page.inner_text("#n-running").strip().isdigit()
    assert int(page.inner_text("#n-steps")) > 0
    changed: set[str] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not {"kv-map", "split-chart", "queue-chart"} <= changed:
        time.sleep(1.0)
        now = _canvas_pixels(page)
        changed |= {c for c in CANVASES if now[c] and now[c] != first[c]}
    page.screenshot(path=os.path.join(OUT_DIR, "dashboard.png"), full_page=True)
    assert _updates(page) > n1
    assert {"kv-map", "split-chart", "queue-chart"} <= changed, f"charts that changed: {sorted(changed)}"
    assert not errors, errors
    page.close()


def test_timeline_html_loads_in_the_browser(loaded_server, browser, tmp_path):
    from minivllm.bench.timeline import PANELS, write_timeline
    engine, _ = loaded_server
    records = engine.history.since(0).records
    assert len(records) > 5
    path = write_timeline(records, str(tmp_path / "timeline.html"), "served run")
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.goto("file://" + path)
    boxes = page.evaluate("[...document.querySelectorAll('svg.panel')].map(s => s.getBoundingClientRect().height)")
    assert len(boxes) == len(PANELS) and all(h > 100 for h in boxes)
    assert page.evaluate("document.querySelectorAll('polyline').length") == sum(len(ls) for _, ls in PANELS)
    assert "steps over" in page.inner_text("#summary")
    os.makedirs(OUT_DIR, exist_ok=True)
    page.screenshot(path=os.path.join(OUT_DIR, "timeline.png"), full_page=True)
    page.close()
