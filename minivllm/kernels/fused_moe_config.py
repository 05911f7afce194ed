"""Tile configurations of the fused MoE kernels, per GPU and shape, found by a sweep.

`scripts/sweep_fused_moe.py` times candidate tiles on the GPU and writes
`kernels/configs/fused_moe/<GPU name>.json`, kept in the repository:

    {"E=128,N=768,K=2048,dtype=bfloat16": {          # experts, expert width I, hidden size
        "1":  {"BLOCK_M": 16, "up": {tile}, "down": {tile}},    # per token count M
        "64": {...}, ...}}
    tile = {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}

"up" is the gate/up GEMM (SiLU-and-mul fused), "down" the down GEMM; both share BLOCK_M, the
block the tokens are aligned to. At run time the entry of the nearest measured M is used if it
is within a factor of two of the step's M (a sweep of decode sizes only says nothing about a
prefill); otherwise, or with no file for the GPU or no entry for the shape, `default_config` (a
heuristic) is.
"""

from __future__ import annotations

import functools
import os

from minivllm.kernels.tuned_tables import device_table, table_file

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "fused_moe")


def shape_key(num_experts: int, inter: int, hidden: int, dtype_name: str) -> str:
    return f"E={num_experts},N={inter},K={hidden},dtype={dtype_name}"


def config_file(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> .../NVIDIA_H100_80GB_HBM3.json"""
    return table_file(CONFIG_DIR, device_name)


@functools.lru_cache(maxsize=8)
def load_configs(device_name: str) -> dict:
    """The sweep's results for this GPU or its sibling's (tuned_tables.device_table; {} when none
    were kept)."""
    return device_table(CONFIG_DIR, device_name)


def default_config(m: int, num_experts: int, top_k: int) -> dict:
    """A heuristic when no sweep result exists: small blocks while each expert gets a few rows
    (decode: each selected expert's weights are read once, by many programs along N), larger
    tiles once the experts' runs are long (prefill: the GEMMs are compute-bound)."""
    rows_per_expert = m * top_k / num_experts
    if rows_per_expert <= 16:
        tile = {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
        return {"BLOCK_M": 16, "up": dict(tile, BLOCK_N=32), "down": tile}
    if rows_per_expert <= 128:
        tile = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
        return {"BLOCK_M": 32, "up": tile, "down": tile}
    tile = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    return {"BLOCK_M": 64, "up": dict(tile, BLOCK_N=64), "down": tile}


@functools.lru_cache(maxsize=4096)
def pick_config(device_name: str, m: int, num_experts: int, inter: int, hidden: int, top_k: int,
                dtype_name: str) -> dict:
    """The tile configuration for a step of m tokens: the sweep's entry for the nearest m, else
    the default. Cached (each layer of each eager step asks); treat the result as read-only."""
    table = load_configs(device_name).get(shape_key(num_experts, inter, hidden, dtype_name))
    if table:
        nearest = min(table, key=lambda k: abs(int(k) - m))
        if int(nearest) <= 2 * max(m, 1) and m <= 2 * int(nearest):
            return table[nearest]
    return default_config(m, num_experts, top_k)
