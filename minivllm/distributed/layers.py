"""Tensor-parallel layers of the decoder (models/llama.py builds them from a ShardPlan).

Linear layers need no class of their own: a column-parallel linear (q/k/v, gate/up: output
features split) and a row-parallel one (o_proj, down_proj: input features split) are the model's
ordinary linear modules built with the rank's local sizes, so the CPU's packed kernels and the
quantized methods apply to them unchanged. What makes them parallel:
  - loading: each rank reads its slice of every checkpoint tensor (ShardPlan.checkpoint_slice;
    the fused q/k/v and gate/up matrices hold this rank's q, k, v / gate, up slices side by side);
  - the owner of a row-parallel layer sums its partial outputs over the group
    (TensorParallelGroup.all_reduce) before the residual add; these layers have no bias.
The vocabulary layers below do need their own forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.communication import TensorParallelGroup
from minivllm.distributed.sharding import ShardPlan


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [vocab_start, vocab_start + vocab_per_rank) of the padded vocabulary:
    each rank looks up the ids it holds (zeros elsewhere) and the group sums: exact, as every
    row but one is zero."""

    def __init__(self, hidden_size: int, plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.start, self.num = plan.vocab_start, plan.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The LM head rows of the same vocabulary slice: each rank computes its logits, the group
    gathers them in rank order and the padding columns are cut, so every rank holds the same
    [T, vocab_size] logits (and samples the same tokens from them)."""

    def __init__(self, hidden_size: int, vocab_size: int, plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.out_features = vocab_size
        # a child module: the CPU's packing (models/cpu_linear.py) replaces it like any linear
        self.linear = nn.Linear(hidden_size, plan.vocab_per_rank, bias=False)
        self.tp = tp

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.linear(hidden))[..., :self.vocab_size]
