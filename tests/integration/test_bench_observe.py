"""`minivllm bench ... --timeline FILE --profile`: the run's timeline and a Chrome trace are
written (a tiny model on the CPU, seconds)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_throughput_writes_timeline_and_profile(tmp_path):
    png, trace_dir = tmp_path / "w1.png", tmp_path / "traces"
    cmd = [sys.executable, "-m", "minivllm", "bench", "throughput", "--workload", "W1", "--model-config",
           "tiny-llama", "--device", "cpu", "--num-requests", "6", "--max-output", "12", "--max-prompt", "64",
           "--timeline", str(png), "--profile", "--profile-dir", str(trace_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import matplotlib.image
    img = matplotlib.image.imread(png)
    assert img.shape[1] > 600 and img[..., :3].std() > 0.05
    (trace,) = trace_dir.glob("bench-*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::" in n for n in names)  # the model's ops, on the CPU
    assert any(n.startswith("minivllm.") for n in names)  # the engine's own host phases
