"""Process groups of one rank: the world, its tensor-parallel group and its pipeline link.

    global rank = pp_rank * tp_size + tp_rank          tp=2, pp=2:   stage 0: ranks 0 1
    TP group of a stage: its tp consecutive ranks                     stage 1: ranks 2 3
    pipeline: rank r sends to r + tp_size (the same TP rank of the next stage)

Expert parallelism across data-parallel replicas (enable_expert_parallel, data_parallel_size > 1)
puts every replica's ranks in one world, replica d's ranks at d * (tp x pp) + their own rank;
each replica keeps its own TP groups, and the MoE layers' all_to_alls span the whole world.

Nothing here is global: the runner owns its ParallelGroups and passes it to the model."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.distributed import symm_all_reduce
from minivllm.distributed.communication import PipelineLink, TensorParallelGroup
from minivllm.distributed.sharding import RankInfo

# a collective that waits longer than this fails (a dead peer is normally seen by the executor
# long before: it watches every worker)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class ExpertParallelInfo:
    """This rank's place among the expert-parallel ranks (models/moe.py's layouts)."""

    rank: int
    size: int
    all_to_all: bool  # True: ranks of several replicas (tokens travel); False: the TP ranks of one


@dataclass
class ParallelGroups:
    rank: RankInfo
    tp: TensorParallelGroup
    pipeline: PipelineLink | None  # None with a single stage
    ep: ExpertParallelInfo | None = None  # None: every rank holds every expert

    @classmethod
    def single(cls, device: torch.device) -> ParallelGroups:
        """World size 1: no process group at all."""
        return cls(RankInfo(), TensorParallelGroup(None, 0, 1, device), None)


def init_distributed(rank: RankInfo, init_method: str, device: torch.device, replica: int = 0,
                     num_replicas: int = 1, expert_parallel: bool = False,
                     disable_custom_all_reduce: bool = False) -> ParallelGroups:
    """Join the world (gloo on the CPU, NCCL on CUDA) and build the TP groups and pipeline link.
    Every rank calls this with its own RankInfo and the same init_method (tcp://host:port).
    replica / num_replicas: this rank's data-parallel replica, when the world spans the replicas
    (expert parallelism across them); expert_parallel: the MoE layers' experts are split over
    the world's ranks (else every rank holds every expert); disable_custom_all_reduce: NCCL for
    every all-reduce (else decode-sized ones go through symmetric memory where it works)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    base = replica * rank.world_size  # the first global rank of this replica
    world = num_replicas * rank.world_size
    dist.init_process_group(backend, init_method=init_method, rank=base + rank.rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    tp_group = None
    for d in range(num_replicas):  # every rank creates every group, in the same order
        for stage in range(rank.pp_size):
            ranks = [d * rank.world_size + rank.global_rank(t, stage) for t in range(rank.tp_size)]
            group = dist.new_group(ranks) if rank.tp_size > 1 else None
            if d == replica and stage == rank.pp_rank:
                tp_group = group
    tp = TensorParallelGroup(tp_group, rank.tp_rank, rank.tp_size, device)
    if tp.size > 1:  # creates the communicator now, never inside a CUDA graph capture
        tp.all_reduce(torch.zeros(1, device=device))
        tp.custom = symm_all_reduce.build(tp_group, tp.size, device, disable_custom_all_reduce)
    link = None
    if rank.pp_size > 1:
        prev = None if rank.is_first_stage else base + rank.global_rank(rank.tp_rank, rank.pp_rank - 1)
        nxt = None if rank.is_last_stage else base + rank.global_rank(rank.tp_rank, rank.pp_rank + 1)
        link = PipelineLink(prev, nxt, depth=rank.pp_size)
    ep = ExpertParallelInfo(base + rank.rank, world, num_replicas > 1) if expert_parallel and world > 1 else None
    if ep is not None and ep.all_to_all:  # the all_to_all's communicator, created before any step
        dist.all_reduce(torch.zeros(1, device=device))
    return ParallelGroups(rank, tp, link, ep)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
