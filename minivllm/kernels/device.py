"""The GPU facts the kernels size their grids by: the number of SMs (split-K, split counts, tile
widths), and which GPU a device names."""

from __future__ import annotations

import functools

import torch

H100_SMS = 132  # off CUDA (Triton's interpreter, CPU tests): grids are sized as for an H100


def num_sms(device: torch.device | str) -> int:
    """The SM count of `device`'s GPU (device index None: GPU 0); H100_SMS off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return H100_SMS
    return _cuda_sms(device.index or 0)


@functools.lru_cache(maxsize=None)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (index None: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()
