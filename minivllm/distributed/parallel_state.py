"""Process groups of one rank: the world, its tensor-parallel group and its pipeline link.

    global rank = pp_rank * tp_size + tp_rank          tp=2, pp=2:   stage 0: ranks 0 1
    TP group of a stage: its tp consecutive ranks                     stage 1: ranks 2 3
    pipeline: rank r sends to r + tp_size (the same TP rank of the next stage)

Nothing here is global: the runner owns its ParallelGroups and passes it to the model."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.distributed.communication import PipelineLink, TensorParallelGroup
from minivllm.distributed.sharding import RankInfo

# a collective that waits longer than this fails (a dead peer is normally seen by the executor
# long before: it watches every worker)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class ParallelGroups:
    rank: RankInfo
    tp: TensorParallelGroup
    pipeline: PipelineLink | None  # None with a single stage

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroups:
        """World size 1: no process group at all."""
        return cls(RankInfo(), TensorParallelGroup(None, 0, 1, device), None)


def init_distributed(rank: RankInfo, init_method: str, device: torch.device) -> ParallelGroups:
    """Join the world (gloo on the CPU, NCCL on CUDA) and build the TP groups and pipeline link.
    Every rank calls this with its own RankInfo and the same init_method (tcp://host:port)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank.rank, world_size=rank.world_size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    tp_group = None
    for stage in range(rank.pp_size):  # every rank creates every group, in the same order
        ranks = [rank.global_rank(t, stage) for t in range(rank.tp_size)]
        group = dist.new_group(ranks) if rank.tp_size > 1 else None
        if stage == rank.pp_rank:
            tp_group = group
    tp = TensorParallelGroup(tp_group, rank.tp_rank, rank.tp_size, device)
    if tp.size > 1:  # creates the communicator now, never inside a CUDA graph capture
        tp.all_reduce(torch.zeros(1, device=device))
    link = None
    if rank.pp_size > 1:
        prev = None if rank.is_first_stage else rank.global_rank(rank.tp_rank, rank.pp_rank - 1)
        nxt = None if rank.is_last_stage else rank.global_rank(rank.tp_rank, rank.pp_rank + 1)
        link = PipelineLink(prev, nxt, depth=rank.pp_size)
    return ParallelGroups(rank, tp, link)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
