"""The sparse mixture-of-experts block: router, routed experts, optional shared expert.

    x [T, H] --gate--> logits [T, E] --softmax, top-k (, renormalise)--> weights, ids [T, k]
      --experts (kernels/fused_moe.py; across ranks: models/expert_parallel.py)--> [T, H]
      (+ sigmoid(shared_expert_gate(x)) * shared_expert(x), Qwen2-MoE)

Expert weights are stacked per layer at load time (models/weights.py):
    experts.w13 [E_local, 2 I, H]: each expert's gate rows, then its up rows (HF's gate_proj / w1,
                                   then up_proj / w3)
    experts.w2  [E_local, H, I]:   down_proj / w2
Across ranks (distributed/sharding.py, models/expert_parallel.py), one of three layouts:
    tensor parallel       every rank holds every expert, I / tp of its features (inter_start ..
                          + inter): a partial output, summed by the TP all-reduce (row-parallel,
                          as the dense MLP)
    expert parallel, tp   (dp = 1) rank r holds whole experts E / tp; hidden states are the same
                          on every TP rank (attention's all-reduce), so each rank runs its own
                          experts for the entries routed to them and the TP all-reduce sums the
                          partial outputs: no all-to-all is needed in this layout
    expert parallel, dp   (dp > 1) experts over every dp x tp rank; each replica's tokens travel
                          to their experts' ranks and back (all_to_all, expert_parallel_moe);
                          with tp > 1 each TP rank sends its share of the rows, the all-reduce
                          puts the shares together
A shared expert is split like a dense MLP (I_shared / tp) and joins the same all-reduce.
Each block counts the tokens routed to each expert (`token_counts`, int64 [E], global ids, all of
this replica's tokens on every TP rank), on the device, without a sync: the runner reads them
(runner/expert_counts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.communication import TensorParallelGroup
from minivllm.kernels.fused_moe import count_expert_tokens, fused_moe, topk_softmax
from minivllm.models.arch import MoEConfig
from minivllm.models.expert_parallel import ExpertComm, ExpertPlacement, expert_parallel_moe
from minivllm.models.layers import MLP
from minivllm.quant.config import QuantConfig


class FusedMoE(nn.Module):
    """The routed experts of one layer: this rank's experts (placement), each with this rank's
    slice of its intermediate features [inter_start, inter_start + inter) of full_inter.

    placement.size > 1 with a communicator: tokens travel to their experts' ranks (all_to_all);
    without one: every rank sees the same tokens and computes its own experts' part."""

    def __init__(self, hidden: int, inter: int, placement: ExpertPlacement, comm: ExpertComm | None = None,
                 inter_start: int = 0, full_inter: int | None = None) -> None:
        super().__init__()
        self.placement, self.comm = placement, comm
        self.hidden, self.inter = hidden, inter
        self.inter_start, self.full_inter = inter_start, full_inter or inter
        self.w13 = nn.Parameter(torch.empty(placement.num_local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(placement.num_local, hidden, inter))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                stats: torch.Tensor | None = None, token_valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], topk_* [T, k] (global expert ids) -> [T, H]; stats: see fused_moe."""
        if self.placement.size == 1:
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, stats=stats, token_valid=token_valid)
        if stats is not None:
            count_expert_tokens(stats, topk_ids, token_valid)
        if self.comm is None:  # the same tokens on every rank: this rank's experts' share only
            return fused_moe(x, self.w13, self.w2, topk_weights, self.local_ids(topk_ids), local_only=True)
        return expert_parallel_moe(x, topk_weights, topk_ids, self.placement, self.comm, self._local)

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's local ids, -1 for an expert another rank holds."""
        local = topk_ids - self.placement.first
        return torch.where((local >= 0) & (local < self.placement.num_local), local, -1).to(torch.int32)

    def _local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(local_ids.shape, dtype=torch.float32, device=rows.device)
        return fused_moe(rows, self.w13, self.w2, ones, local_ids)

    def idle_step(self) -> None:
        """Take part in the layer's all_to_alls with no tokens of this rank's own (a replica with
        nothing scheduled: the other ranks' tokens for this rank's experts are still computed)."""
        x = self.w13.new_empty(0, self.hidden)
        ids = torch.empty(0, 1, dtype=torch.int32, device=x.device)
        expert_parallel_moe(x, torch.empty(0, 1, device=x.device), ids, self.placement, self.comm, self._local)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ a shared expert): the MLP of a sparse layer.

    Module names follow Hugging Face's Qwen2/3-MoE (`gate`, `experts`, `shared_expert`,
    `shared_expert_gate`), so most checkpoint names map one to one. tp: the tensor-parallel
    group whose all-reduce sums the partial outputs (None: one rank); expert_inter /
    shared_inter: this rank's features of each routed expert / of the shared expert (None:
    all; distributed/sharding.py's ShardPlan)."""

    def __init__(self, hidden: int, cfg: MoEConfig, placement: ExpertPlacement | None = None,
                 comm: ExpertComm | None = None, quant: QuantConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup | None = None, expert_inter: int | None = None,
                 shared_inter: int | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.tp = tp
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)  # replicated on every rank
        inter = expert_inter or cfg.intermediate_size
        start = tp.rank * inter if tp is not None and inter < cfg.intermediate_size else 0
        self.experts = FusedMoE(hidden, inter, placement or ExpertPlacement(cfg.num_experts), comm, start,
                                cfg.intermediate_size)
        shared = shared_inter or cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(hidden, shared, quant, f"{prefix}.shared_expert") if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None
        self.register_buffer("token_counts", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, token_valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; token_valid: bool [T], the tokens counted in token_counts (None: all)."""
        weights, ids = topk_softmax(self.gate(x), self.top_k, self.renormalize)
        out = self._routed(x, weights, ids, token_valid)
        if self.shared_expert is not None:  # the sigmoid gate is per token: it scales partial sums alike
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _routed(self, x, weights, ids, token_valid) -> torch.Tensor:
        if self.experts.comm is None or self.tp is None:
            return self.experts(x, weights, ids, stats=self.token_counts, token_valid=token_valid)
        # all_to_all expert parallelism with tp > 1: the TP ranks hold the same rows; each sends
        # its contiguous share, and the all-reduce of the zero-padded outputs joins the shares
        count_expert_tokens(self.token_counts, ids, token_valid)
        share = -(-x.shape[0] // self.tp.size)
        lo, hi = min(self.tp.rank * share, x.shape[0]), min((self.tp.rank + 1) * share, x.shape[0])
        out = x.new_zeros(x.shape)
        out[lo:hi] = self.experts(x[lo:hi], weights[lo:hi], ids[lo:hi])
        return out
