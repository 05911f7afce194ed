"""Communication ops of one rank: all-reduce and all-gather within its tensor-parallel group,
and send/recv of a step's hidden states between pipeline stages. torch.distributed underneath:
NCCL on CUDA, gloo on the CPU.

A group of size 1 does nothing (no call at all), so the single-rank path costs nothing. On CUDA
the all-reduce and all-gather are NCCL collectives on the current stream, except decode-sized
all-reduces, which go through symmetric memory (symm_all_reduce.py); all are captured into CUDA
graphs like any kernel (the communicator and the symmetric buffers are set up before any
capture, parallel_state.init_distributed)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minivllm.distributed.symm_all_reduce import SymmetricAllReduce


class TensorParallelGroup:
    """The ranks that split each layer of one pipeline stage."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, device: torch.device) -> None:
        self.group, self.rank, self.size = group, rank, size
        # gloo has no all_gather_into_tensor; NCCL gathers into one buffer (one kernel, graph-safe)
        self._gather_into_tensor = device.type == "cuda"
        # decode-sized all-reduces through symmetric memory (distributed/symm_all_reduce.py);
        # set by parallel_state.init_distributed, None: NCCL for every message
        self.custom: SymmetricAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x. Every rank gets the same bits (NCCL's ring:
        each chunk is summed once and then copied; the custom kernels sum in rank order), so
        later replicated work stays identical."""
        if self.size > 1:
            if self.custom is not None and self.custom.can_reduce(x):
                return self.custom.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N] on every rank -> [..., size * N], rank order along the last dimension."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self._gather_into_tensor:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
        else:
            out = torch.stack(_gather_list(x, self.group, self.size))
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])


def _gather_list(x: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return parts


class PipelineLink:
    """Hidden states between neighbouring stages (the same TP rank in each): a stage sends the
    residual stream and the last layer's output of a step as one [2, T, H] tensor.

    Sends are asynchronous, so a stage goes on to its next batch while the next stage receives
    this one; at most `depth` sends stay open (each keeps its tensor alive until it completes)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, depth: int) -> None:
        self.prev_rank, self.next_rank, self.depth = prev_rank, next_rank, depth
        self._open: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.next_rank is not None, "the last stage sends nothing"
        packed = torch.stack([hidden, residual])
        while len(self._open) >= self.depth:
            self._open.pop(0)[0].wait()
        self._open.append((dist.isend(packed, self.next_rank), packed))

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual) of the step, each [num_tokens, hidden_size]."""
        assert self.prev_rank is not None, "the first stage receives nothing"
        packed = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(packed, self.prev_rank)
        return packed[0], packed[1]

    def flush(self) -> None:
        """Wait for every open send (shutdown)."""
        while self._open:
            self._open.pop(0)[0].wait()
