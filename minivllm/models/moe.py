"""The sparse mixture-of-experts block: router, routed experts, optional shared expert.

    x [T, H] --gate--> logits [T, E] --softmax, top-k (, renormalise)--> weights, ids [T, k]
      --experts (kernels/fused_moe.py; across ranks: models/expert_parallel.py)--> [T, H]
      (+ sigmoid(shared_expert_gate(x)) * shared_expert(x), Qwen2-MoE)

Expert weights are stacked per layer at load time (models/weights.py):
    experts.w13 [E_local, 2 I, H]: each expert's gate rows, then its up rows (HF's gate_proj / w1,
                                   then up_proj / w3)
    experts.w2  [E_local, H, I]:   down_proj / w2
Each block counts the tokens routed to each expert (`token_counts`, int64 [E], global ids), on
the device, without a sync: the runner reads them (runner.expert_token_counts()).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.fused_moe import count_expert_tokens, fused_moe, topk_softmax
from minivllm.models.arch import MoEConfig
from minivllm.models.expert_parallel import ExpertComm, ExpertPlacement, expert_parallel_moe
from minivllm.models.layers import MLP
from minivllm.quant.config import QuantConfig


class FusedMoE(nn.Module):
    """The routed experts of one layer (this rank's share of them under expert parallelism)."""

    def __init__(self, hidden: int, inter: int, placement: ExpertPlacement, comm: ExpertComm | None = None) -> None:
        super().__init__()
        if placement.size > 1 and comm is None:
            raise ValueError("expert parallelism needs a communicator (ExpertComm)")
        self.placement, self.comm = placement, comm
        self.hidden, self.inter = hidden, inter
        self.w13 = nn.Parameter(torch.empty(placement.num_local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(placement.num_local, hidden, inter))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                stats: torch.Tensor | None = None, token_valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], topk_* [T, k] (global expert ids) -> [T, H]; stats: see fused_moe."""
        if self.placement.size == 1:
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, stats=stats, token_valid=token_valid)
        if stats is not None:
            count_expert_tokens(stats, topk_ids, token_valid)
        return expert_parallel_moe(x, topk_weights, topk_ids, self.placement, self.comm, self._local)

    def _local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(local_ids.shape, dtype=torch.float32, device=rows.device)
        return fused_moe(rows, self.w13, self.w2, ones, local_ids)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ a shared expert): the MLP of a sparse layer.

    Module names follow Hugging Face's Qwen2/3-MoE (`gate`, `experts`, `shared_expert`,
    `shared_expert_gate`), so most checkpoint names map one to one."""

    def __init__(self, hidden: int, cfg: MoEConfig, placement: ExpertPlacement | None = None,
                 comm: ExpertComm | None = None, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.experts = FusedMoE(hidden, cfg.intermediate_size, placement or ExpertPlacement(cfg.num_experts), comm)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(hidden, shared, quant, f"{prefix}.shared_expert") if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None
        self.register_buffer("token_counts", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, token_valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; token_valid: bool [T], the tokens counted in token_counts (None: all)."""
        weights, ids = topk_softmax(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids, stats=self.token_counts, token_valid=token_valid)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
