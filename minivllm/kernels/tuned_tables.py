"""Where the kernel sweeps keep their results: one JSON table per GPU model under
kernels/configs/<kernel>/, named after the device ("NVIDIA H100 80GB HBM3" ->
NVIDIA_H100_80GB_HBM3.json). Used by the fused MoE (fused_moe_config.py) and the dense GEMV
(dense_gemv.py); the sweeps that write them are in scripts/."""

from __future__ import annotations

import json
import os
import re


def table_file(config_dir: str, device_name: str) -> str:
    """The table's path for this GPU in config_dir."""
    return os.path.join(config_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) + ".json")


def read_table(path: str) -> dict:
    """The table at path ({} when no sweep result was kept for this GPU)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
