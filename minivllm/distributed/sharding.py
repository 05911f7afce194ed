"""Which part of the model a rank holds: pure arithmetic on the architecture (no torch).

Tensor parallelism (tp ranks of one pipeline stage) splits
  - attention heads: rank r has query heads [r * Hq/tp, (r+1) * Hq/tp); KV heads the same way
    when tp <= Hkv, else one KV head each, replicated over tp/Hkv consecutive ranks (the KV head
    its query heads read: Hq/Hkv query heads per KV head, so rank r needs KV head r // (tp/Hkv));
  - the MLP's intermediate features (gate/up rows, down columns) in tp equal parts; a MoE
    layer's shared expert likewise, and each routed expert too (every rank holds every expert,
    1/tp of its features), unless expert parallelism gives each rank whole experts instead
    (models/expert_parallel.py: E / ranks of them, at full width);
  - the vocabulary (embedding and LM head rows), padded to a multiple of VOCAB_PADDING first,
    in tp equal parts; padding rows are zero and their logits are cut before sampling.
Pipeline parallelism (pp stages) gives each stage a contiguous range of layers; the first
stages take one layer more when pp does not divide the layer count (the last stage also runs the
final norm and the LM head).
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // pad_to) * pad_to


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage pp_rank runs (contiguous, every stage >= 1)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: its tensor-parallel rank within its pipeline stage, and that stage.
    Global rank = pp_rank * tp_size + tp_rank (the ranks of a stage are consecutive)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank whose sampled tokens go back to the engine: the last stage's first TP rank."""
        return self.is_last_stage and self.tp_rank == 0

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int) -> RankInfo:
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)

    def global_rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank


@dataclass(frozen=True)
class ShardPlan:
    """The slices of the architecture a rank holds (see the module docstring)."""

    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # first global KV head held
    intermediate_size: int  # local MLP features
    vocab_start: int  # first global vocabulary row held
    vocab_per_rank: int  # rows held (padded vocabulary / tp)
    layer_start: int
    layer_end: int
    moe_intermediate_size: int = 0  # local features of each routed expert (0: dense model)
    shared_expert_intermediate_size: int = 0  # local features of a MoE layer's shared expert

    @classmethod
    def build(cls, arch, rank: RankInfo, expert_parallel: bool = False) -> ShardPlan:
        """arch: an ArchConfig (or anything with its fields); checks are the config builder's.
        expert_parallel: routed experts are whole on their rank (not split over tp)."""
        tp, r = rank.tp_size, rank.tp_rank
        heads = arch.num_heads // tp
        if tp <= arch.num_kv_heads:
            kv, kv_start = arch.num_kv_heads // tp, r * (arch.num_kv_heads // tp)
        else:
            kv, kv_start = 1, r // (tp // arch.num_kv_heads)
        vocab = arch.vocab_size if tp == 1 else padded_vocab_size(arch.vocab_size) // tp
        start, end = stage_layers(arch.num_layers, rank.pp_size, rank.pp_rank)
        moe = getattr(arch, "moe", None)
        moe_inter = 0 if moe is None else moe.intermediate_size // (1 if expert_parallel else tp)
        shared = 0 if moe is None else moe.shared_expert_intermediate_size // tp
        return cls(heads, kv, kv_start, arch.intermediate_size // tp, r * vocab, vocab, start, end, moe_inter, shared)

    def checkpoint_slice(self, kind: str, rank: RankInfo, head_dim: int) -> tuple[int, int, int] | None:
        """(dim, start, length) of a checkpoint tensor of module `kind` this rank loads, None for a
        whole (replicated) tensor. kind: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
        down_proj (a dense MLP's), shared_gate_proj, shared_up_proj, shared_down_proj (a MoE
        shared expert's), embed_tokens, lm_head; anything else is replicated (routed experts:
        models/moe_weights.py cuts them)."""
        if rank.tp_size == 1:
            return None
        r = rank.tp_rank
        if kind == "q_proj":
            return 0, r * self.num_heads * head_dim, self.num_heads * head_dim
        if kind in ("k_proj", "v_proj"):
            return 0, self.kv_head_start * head_dim, self.num_kv_heads * head_dim
        if kind == "o_proj":
            return 1, r * self.num_heads * head_dim, self.num_heads * head_dim
        if kind in ("gate_proj", "up_proj"):
            return 0, r * self.intermediate_size, self.intermediate_size
        if kind == "down_proj":
            return 1, r * self.intermediate_size, self.intermediate_size
        if kind in ("shared_gate_proj", "shared_up_proj"):
            return 0, r * self.shared_expert_intermediate_size, self.shared_expert_intermediate_size
        if kind == "shared_down_proj":
            return 1, r * self.shared_expert_intermediate_size, self.shared_expert_intermediate_size
        if kind in ("embed_tokens", "lm_head"):
            return 0, self.vocab_start, self.vocab_per_rank  # may run past the real vocabulary
        return None
