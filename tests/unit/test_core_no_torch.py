"""The pure-Python core (scheduler, block manager, request state, sampling params) imports no torch.

Runs in a fresh interpreter so that torch already imported by other tests does not hide an import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import importlib.abc, json, sys

    attempts = []

    class BlockTorch(importlib.abc.MetaPathFinder):
        # refuse torch and every torch.* submodule, and remember who tried
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                attempts.append(name)
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    assert "torch" not in sys.modules

    import minivllm.core.request
    import minivllm.core.block_manager
    import minivllm.core.queues
    import minivllm.core.interfaces
    import minivllm.core.scheduler
    import minivllm.sampling_params

    # the modules work, not just import: build a request and run one scheduling step
    from minivllm.core.block_manager import BlockManager
    from minivllm.core.interfaces import RunnerOutput
    from minivllm.core.request import Request
    from minivllm.core.scheduler import Scheduler, SchedulerLimits
    from minivllm.sampling_params import SamplingParams

    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                      BlockManager(num_blocks=8, block_size=4, enable_caching=True))
    sched.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), frozenset(), 0.0, 2))
    out = sched.schedule()
    sched.update(out, RunnerOutput(["r"], [[7]]))
    print(json.dumps({
        "torch_in_sys_modules": "torch" in sys.modules,
        "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "attempts": attempts,
        "scheduled": [s.req_id for s in out.scheduled],
        "output": sched.requests["r"].output_token_ids,
    }))
""")


def test_core_imports_without_torch():
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"core import failed with torch blocked:\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch_in_sys_modules"] is False
    assert result["torch_modules"] == []
    assert result["attempts"] == [], f"the core tried to import torch: {result['attempts']}"
    assert result["scheduled"] == ["r"]
    assert result["output"] == [7]
