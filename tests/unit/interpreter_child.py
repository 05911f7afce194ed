"""Runs check code in a child process under Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is first imported) and returns the JSON object the child prints after "RESULT ".

The child gets, before `body` runs: `checks` (the GPU test module `checks_file`, imported for its
check helpers), `json`, `sys`, `torch`, and `f32`, `f16`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = """
import importlib.util, json, sys
import torch

spec = importlib.util.spec_from_file_location("interpreter_checks", sys.argv[1])
checks = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = checks
spec.loader.exec_module(checks)
f32, f16 = torch.float32, torch.float16
"""


def run_under_interpreter(body: str, checks_file: Path, timeout_s: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + body, str(checks_file)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])
