"""The GPU fact the kernels size their grids by: the number of SMs (split-K, split counts, tile widths)."""

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
