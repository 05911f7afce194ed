"""The Llama family (Llama 2/3, SmolLM2, Mistral), Qwen2/Qwen3 and their mixture-of-experts
variants (Qwen2-MoE, Qwen3-MoE, Mixtral) as one decoder: they differ only by config flags
(qk-norm, attention bias, tied embeddings, rope scaling, and `cfg.moe`: which layers' MLP is a
sparse MoE block, models/moe.py).

Under tensor/pipeline parallelism (distributed/) the same classes hold one rank's part: its
heads, MLP features and vocabulary rows (distributed/sharding.py's ShardPlan), and only its
pipeline stage's layers (`layers` holds layer_start .. layer_end - 1; the first stage alone has
the embedding, the last alone the final norm and the LM head). A MoE layer is split over the
TP ranks by features or, with expert parallelism, by whole experts (models/moe.py's layouts;
pipeline parallelism of MoE models is refused by config_builder)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.distributed.layers import ParallelLMHead, VocabParallelEmbedding
from minivllm.distributed.parallel_state import ParallelGroups
from minivllm.distributed.sharding import RankInfo, ShardPlan
from minivllm.models.arch import ArchConfig
from minivllm.models.expert_parallel import ExpertComm, ExpertPlacement, TorchDistComm
from minivllm.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from minivllm.models.moe import SparseMoeBlock
from minivllm.quant.config import QuantConfig


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next: the last layer's output and the residual stream,
    each [num_tokens, hidden_size] (the next layer adds them before its norm)."""

    hidden: torch.Tensor
    residual: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, plan: ShardPlan, rotary: RotaryEmbedding, backend: AttentionBackend,
                 index: int, quant: QuantConfig | None = None, placement: ExpertPlacement | None = None,
                 comm: ExpertComm | None = None, tp=None) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, plan.num_heads, plan.num_kv_heads, cfg.head_dim,
                                   cfg.attention_bias, cfg.qk_norm, cfg.rms_norm_eps, rotary, backend,
                                   quant, f"{prefix}.self_attn", tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        # a sparse layer's routed experts stay unquantized (only its shared expert follows `quant`)
        self.mlp = (SparseMoeBlock(cfg.hidden_size, cfg.moe, placement, comm, quant, f"{prefix}.mlp", tp,
                                   plan.moe_intermediate_size, plan.shared_expert_intermediate_size) if self.is_moe
                    else MLP(cfg.hidden_size, plan.intermediate_size, quant, f"{prefix}.mlp", tp))
        # o_proj .. down_proj of a one-token step in one persistent launch (kernels/w4_layer_tail.py:
        # attached by the runner to eligible 4-bit layers on Hopper with MINIVLLM_W4_LAYER_TAIL=1)
        self.tail = None

    def forward(self, positions, hidden, residual, meta, token_valid: torch.Tensor | None = None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.tail is not None and hidden.shape[0] == 1:
            return self.tail(self.self_attn.attend(positions, hidden, meta), residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return (self.mlp(hidden, token_valid) if self.is_moe else self.mlp(hidden)), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, max_positions: int,
                 quant: QuantConfig | None = None, placement: ExpertPlacement | None = None,
                 comm: ExpertComm | None = None, parallel: ParallelGroups | None = None) -> None:
        """quant: the model's quantization (its decoder linears become QuantLinear); None:
        unquantized. placement / comm: this rank's experts and the expert-parallel communicator
        (MoE models under expert parallelism; None: every expert here). parallel: this rank's
        groups under tensor/pipeline parallelism; None: the whole model."""
        super().__init__()
        self.cfg = cfg
        self.rank = parallel.rank if parallel is not None else RankInfo()
        ep = parallel.ep if parallel is not None and cfg.moe is not None else None
        if ep is not None:  # expert parallelism: this rank's whole experts (models/moe.py)
            placement = ExpertPlacement(cfg.moe.num_experts, ep.size, ep.rank)
            comm = TorchDistComm() if ep.all_to_all else None  # all_to_all over the whole world
        # a replica with nothing to run still joins every MoE layer's all_to_all (idle_step)
        self.needs_idle_steps = ep is not None and ep.all_to_all
        self.plan = ShardPlan.build(cfg, self.rank, expert_parallel=ep is not None)
        tp = parallel.tp if parallel is not None and parallel.tp.size > 1 else None
        self.tp = tp
        self.layer_start = self.plan.layer_start
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = None
        if self.rank.is_first_stage:
            self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None
                                 else VocabParallelEmbedding(cfg.hidden_size, self.plan, tp))
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.plan, rotary, backend, i, quant, placement, comm, tp)
                                    for i in range(self.plan.layer_start, self.plan.layer_end))
        self.moe_blocks: list[SparseMoeBlock] = [layer.mlp for layer in self.layers if layer.is_moe]
        self.norm = self.lm_head = None
        if self.rank.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if tp is None
                            else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.plan, tp))
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                target = self.lm_head if tp is None else self.lm_head.linear
                target.weight = self.embed_tokens.weight
        # CPU float32: the same math in fewer ops (models/cpu_forward.py), set by the runner
        self.cpu_forward = None
        # every layer's W4 tail also runs the next layer's qkv: one-token steps take forward_tails
        # (kernels/w4_layer_tail.py: attach_layer_tails sets it)
        self.tail_chain = False

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None, num_layers: int | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size], or only
        the rows output_rows ([R] int64 token indices, e.g. the tokens that sample) -> [R, hidden_size].
        Every token's K/V is written either way; the CPU forward also skips the last layer's
        work after attention for the other tokens. num_layers: run only the first layers, then
        the final norm (layer-skip self-speculation drafts with them).
        Pipeline stages: a later stage starts from `intermediate` (the previous stage's output,
        input_ids unused), and every stage but the last returns an IntermediateTensors."""
        if self.cpu_forward is not None:
            return self.cpu_forward.forward(input_ids, positions, meta, output_rows, num_layers, intermediate)
        if self.tail_chain and input_ids.shape[0] == 1 and num_layers is None and intermediate is None:
            hidden = self.forward_tails(input_ids, positions, meta)
            return hidden if output_rows is None else hidden[output_rows]
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        # MoE token counters skip CUDA-graph padding tokens (slot -1)
        token_valid = meta.slot_mapping >= 0 if self.moe_blocks else None
        for layer in self.layers[:num_layers]:
            hidden, residual = layer(positions, hidden, residual, meta, token_valid)
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden if output_rows is None else hidden[output_rows]

    def forward_tails(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One token through the chained W4 tails: the first layer's norm and qkv_proj, then per
        layer attention and one tail launch (o_proj .. down_proj and the next layer's norm and
        qkv_proj, with that layer's rotary and K/V store where the tail takes them; the last
        layer's stops at down_proj), then the final norm -> [1, hidden]."""
        residual = self.embed_tokens(input_ids)
        first = self.layers[0]
        qkv = first.self_attn.qkv_proj(first.input_layernorm(residual))
        stored = False  # whether qkv's q is rotated and its K/V are in the cache (by the previous tail)
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn
            attn = attention.attend_stored(qkv, meta) if stored else attention.attend_qkv(positions, qkv, meta)
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            # the next layer's rotary and K/V store in the tail's qkv stage, where it can
            rope = layer.tail.rope_target(nxt.self_attn, positions, meta.slot_mapping) if nxt is not None else None
            qkv, residual = layer.tail(attn, residual, nxt.tail if nxt is not None else None, rope)
            stored = rope is not None  # the last layer's tail returns (mlp_out, residual)
        hidden, _ = self.norm(qkv, residual)
        return hidden

    def expert_token_counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert since the last reset: int64 [MoE layers, E] on the
        model's device (a new tensor; reading it on the host waits for queued work), or None
        for a dense model."""
        if not self.moe_blocks:
            return None
        return torch.stack([b.token_counts for b in self.moe_blocks])

    def idle_step(self) -> None:
        """Expert parallelism across replicas, a step with no tokens here: every MoE layer's
        all_to_alls, in layer order, so the other replicas' collectives match."""
        for block in self.moe_blocks:
            block.experts.idle_step()

    def reset_expert_token_counts(self) -> None:
        for b in self.moe_blocks:
            b.token_counts.zero_()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, vocab_size] (under tensor parallelism gathered from every rank)."""
        return self.lm_head(hidden)

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T] int64: compute_logits(hidden).argmax(-1), without the [T, V] logits where
        the LM head can fold the argmax into its kernel (PackedLinear.argmax_rows on the CPU)."""
        fused = getattr(self.lm_head, "argmax_rows", None)
        return fused(hidden) if fused is not None else self.compute_logits(hidden).argmax(-1)
