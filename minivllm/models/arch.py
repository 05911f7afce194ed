"""The architecture facts the model needs, read once from an HF config or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

# HF `architectures` name -> flags that distinguish the family on shared layers
_ARCH_FLAGS: dict[str, dict] = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "default_attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


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
    extra: dict = field(default_factory=dict, compare=False)

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
            attention_bias=cfg.get("attention_bias", flags.get("default_attention_bias", False)),
            qk_norm=flags["qk_norm"],
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
