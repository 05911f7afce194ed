"""Expert parallelism: a MoE layer's experts spread over ranks, tokens sent to their experts' ranks.

Placement: with n ranks, rank r owns the contiguous experts [r * E / n, (r + 1) * E / n); E
must be a multiple of n. Each rank routes its own tokens (attention data-parallel), then

    dispatch   each (token, expert) entry goes to the expert's owner: entries sorted by owner,
               counts exchanged (all_to_all of n ints), then the token rows and the owner-local
               expert ids (two all_to_alls with those split sizes)
    compute    the owner runs its local experts on what it received (fused MoE, top-1 a row)
    combine    the results go back the same way (all_to_all with the splits swapped), are put
               back in entry order, weighted by the router and summed over each token's k

    rank 0 (tokens a, b)            rank 1 (token c)         E = 4, k = 2, rank 0 owns 0-1
    a -> (3, 0)  b -> (1, 2)        c -> (0, 3)
    send to 0: a@0 b@1             send to 0: c@0           rank 0 computes a@0 b@1 c@0
    send to 1: a@3 b@2             send to 1: c@3           rank 1 computes a@3 b@2 c@3

The split sizes travel through the host (one device sync a layer), so such a step is not
captured in a CUDA graph. Communication goes through `ExpertComm`: `LocalComm` for one
process, `TorchDistComm` over a torch.distributed process group (gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts rank `rank` of `size` expert-parallel ranks holds."""

    num_experts: int
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"expert parallel rank {self.rank} of size {self.size} is not valid")
        if self.num_experts % self.size:
            raise ValueError(f"expert parallel: num_experts={self.num_experts} is not divisible by the "
                             f"expert-parallel size {self.size} (tensor_parallel_size x data_parallel_size)")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.num_local

    def owns(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local


class ExpertComm(Protocol):
    """The two collectives expert parallelism needs, over the expert-parallel group."""

    rank: int
    size: int

    def all_to_all_counts(self, send_counts: list[int]) -> list[int]:
        """send_counts[d]: rows this rank sends to rank d -> recv_counts[s]: rows it gets from s."""

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """send: [sum(send_counts), ...] rows grouped by destination -> [sum(recv_counts), ...]
        grouped by source rank."""


class LocalComm:
    """One rank: every row stays."""

    rank, size = 0, 1

    def all_to_all_counts(self, send_counts: list[int]) -> list[int]:
        return list(send_counts)

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        return send


class TorchDistComm:
    """torch.distributed all_to_all_single over `group` (None: the default group)."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def all_to_all_counts(self, send_counts: list[int]) -> list[int]:
        send = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        recv = torch.empty_like(send)
        self.dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        self.dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        return recv


def expert_parallel_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        placement: ExpertPlacement, comm: ExpertComm, local_experts) -> torch.Tensor:
    """x [T, H] (this rank's tokens), topk_* [T, k] with global expert ids -> [T, H].

    local_experts(rows [N, H], local_ids [N, 1] int32) -> [N, H]: the owner's experts, one
    expert per row, unweighted (the router's weights are applied back home)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    owner = flat // placement.num_local
    order = torch.argsort(owner, stable=True)  # entries grouped by destination rank
    send_counts = torch.bincount(owner, minlength=comm.size).tolist()
    recv_counts = comm.all_to_all_counts(send_counts)
    rows = comm.all_to_all(x[order // k], send_counts, recv_counts)
    local_ids = comm.all_to_all((flat[order] % placement.num_local).to(torch.int32), send_counts, recv_counts)
    done = local_experts(rows, local_ids.view(-1, 1)) if rows.shape[0] else rows
    back = comm.all_to_all(done, recv_counts, send_counts)  # [T * k, H] in `order`
    per_entry = torch.empty_like(back)
    per_entry[order] = back
    weighted = per_entry.view(t, k, x.shape[1]).float() * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)
