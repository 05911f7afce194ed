"""The architecture facts the model needs, read once from an HF config or GGUF metadata.

Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) are the same decoder with some
MLPs replaced by a sparse MoE block: `ArchConfig.moe` holds that block's facts (None: dense)."""

from __future__ import annotations

from dataclasses import dataclass, field

# HF `architectures` name -> flags that distinguish the family on shared layers. MoE families:
# "moe" names the HF config key holding the expert count; "always_norm_topk": the top-k
# weights are always renormalised (Mixtral), else the config's norm_topk_prob decides;
# "shared_expert": a Qwen2-MoE shared expert beside the routed ones (sigmoid-gated).
_ARCH_FLAGS: dict[str, dict] = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "default_attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": "num_experts"},
    "Qwen2MoeForCausalLM": {"qk_norm": False, "default_attention_bias": True, "moe": "num_experts",
                            "shared_expert": True},
    "MixtralForCausalLM": {"qk_norm": False, "moe": "num_local_experts", "always_norm_topk": True},
}


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MoE block of a mixture-of-experts decoder.

    Router: softmax over `num_experts` logits (fp32), the `top_k` largest, renormalised to sum
    to 1 when `norm_topk_prob`. Each expert is a SwiGLU MLP of width `intermediate_size`.
    A layer i is sparse unless i is in `mlp_only_layers` or (i + 1) % `sparse_step` != 0 (then it
    is a dense MLP of the model's intermediate_size), as in Hugging Face's Qwen2/3-MoE."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.sparse_step}")

    def is_sparse_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.sparse_step == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict, flags: dict) -> MoEConfig:
        def need(key: str):
            if cfg.get(key) is None:
                raise ValueError(f"MoE config lacks {key!r}")
            return cfg[key]
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts: accept either
        num_experts = cfg.get(flags["moe"]) or cfg.get("num_local_experts") or cfg.get("num_experts")
        if num_experts is None:
            raise ValueError(f"MoE config lacks {flags['moe']!r}")
        return cls(
            num_experts=int(num_experts),
            top_k=int(need("num_experts_per_tok")),
            # Mixtral's experts are as wide as its intermediate_size
            intermediate_size=int(cfg.get("moe_intermediate_size") or need("intermediate_size")),
            norm_topk_prob=bool(flags.get("always_norm_topk") or cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if flags.get("shared_expert") else 0,
            sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )


def supported_architectures() -> list[str]:
    return sorted(_ARCH_FLAGS)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    moe: MoEConfig | None = None  # None: every layer is a dense MLP
    extra: dict = field(default_factory=dict, compare=False)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_sparse_layer(i)

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in _ARCH_FLAGS), None)
        if arch is None:
            raise ValueError(f"model architecture {archs} is not supported; supported: {supported_architectures()}")
        flags = _ARCH_FLAGS[arch]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta") or rope_scaling.get("rope_theta") or 10000.0
        if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", flags.get("default_attention_bias", False))),
            qk_norm=flags["qk_norm"],
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            moe=MoEConfig.from_hf_dict(cfg, flags) if "moe" in flags else None,
        )
