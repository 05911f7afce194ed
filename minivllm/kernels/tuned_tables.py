"""Where the kernel sweeps keep their results: one JSON table per GPU model under
kernels/configs/<kernel>/, named after the device ("NVIDIA H100 80GB HBM3" ->
NVIDIA_H100_80GB_HBM3.json). Used by the fused MoE (fused_moe_config.py) and the dense GEMV
(dense_gemv.py), the W4A16 GEMV (w4a16_gemm.py) and the batch-invariant GEMM (invariant_gemm.py); the
sweeps that write them are in scripts/.

A GPU without a kept table of its own borrows its sibling's: the H200 (same 132 SMs and sm_90
instruction set as the H100, more and faster HBM) runs the H100's tuned launches until a sweep on
it is kept, and the other way round. A sibling's tuned launch is a valid launch everywhere (the
tables pick tiles, warps and K slices, never a correctness-relevant setting), and on the same
architecture it is much closer to the best than the untuned defaults."""

from __future__ import annotations

import json
import logging
import os
import re

logger = logging.getLogger(__name__)

# (device-name pattern, the GPUs whose tables it borrows, in order, when it has none of its own)
SIBLINGS = (
    (re.compile(r"\bH(100|200|800)\b|\bGH200\b"), ("NVIDIA H100 80GB HBM3", "NVIDIA H200")),
)


def table_file(config_dir: str, device_name: str) -> str:
    """The table's path for this GPU in config_dir."""
    return os.path.join(config_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) + ".json")


def read_table(path: str) -> dict:
    """The table at path ({} when no sweep result was kept for this GPU)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def device_table(config_dir: str, device_name: str) -> dict:
    """This GPU's kept table in config_dir; else its sibling's (SIBLINGS), logged once per table;
    else {}."""
    own = table_file(config_dir, device_name)
    if os.path.isfile(own):
        return read_table(own)
    for pattern, siblings in SIBLINGS:
        if not pattern.search(device_name):
            continue
        for sibling in siblings:
            path = table_file(config_dir, sibling)
            if os.path.isfile(path):
                logger.info("no tuned %s table for %s: using %s's", os.path.basename(config_dir), device_name, sibling)
                return read_table(path)
    return {}
