"""GGUF files: architecture from the metadata, weights dequantized with the `gguf` package."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from minivllm.models.arch import ArchConfig

# GGUF architecture name -> HF architectures entry (a "llama" file with experts is Mixtral)
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# whether llama.cpp renormalises the top-k weights, where the file does not say
# ({arch}.expert_weights_norm): Qwen3-MoE and Mixtral do, Qwen2-MoE does not
_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}

# GGUF tensor name (per block) -> HF parameter name
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # MoE: router, shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# stacked expert tensors [E, rows, cols] -> one HF tensor per expert: mlp.experts.<e>.<name>
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime: float):
    from gguf import GGUFReader
    return GGUFReader(path)


def open_gguf(path: str):
    """Parse a GGUF file (memory-mapped; parsing its metadata takes seconds, so the reader of
    the last files opened is kept for the config, weight and tokenizer steps)."""
    import os
    try:
        return _open_cached(path, os.path.getmtime(path))
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_arch_config(reader) -> ArchConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_ARCHS)}")
    p = f"{arch}."
    names = {t.name for t in reader.tensors}
    num_heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [_GGUF_ARCHS[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, p + "feed_forward_length"),
        "num_hidden_layers": _field(reader, p + "block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, p + "attention.head_count_kv", num_heads),
        "head_dim": _field(reader, p + "attention.key_length") or hidden // num_heads,
        "rms_norm_eps": _field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, p + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": eos,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    if _field(reader, p + "expert_count"):
        cfg.update(_gguf_moe_fields(reader, arch))
        # which layers are sparse is not in the metadata: those with a router tensor are
        cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        cfg["intermediate_size"] = cfg["intermediate_size"] or cfg["moe_intermediate_size"]
    return ArchConfig.from_hf_dict(cfg)


def _gguf_moe_fields(reader, arch: str) -> dict:
    """The HF config keys of a MoE file's metadata ({arch}.expert_*)."""
    p = f"{arch}."
    num_experts = _field(reader, p + "expert_count")
    inter = _field(reader, p + "expert_feed_forward_length") or _field(reader, p + "feed_forward_length")
    out = {"num_experts": num_experts, "num_local_experts": num_experts,
           "num_experts_per_tok": _field(reader, p + "expert_used_count"),
           "moe_intermediate_size": inter,
           "norm_topk_prob": bool(_field(reader, p + "expert_weights_norm", _GGUF_NORM_TOPK.get(arch, True))),
           "shared_expert_intermediate_size": _field(reader, p + "expert_shared_feed_forward_length")}
    if arch == "llama":
        out["architectures"] = ["MixtralForCausalLM"]
    if out["num_experts_per_tok"] is None:
        raise ValueError(f"GGUF MoE file lacks {p}expert_used_count")
    return out


def _reverse_llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; undo it to HF's layout."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _GgufTensor:
    """One GGUF tensor, dequantized on demand: whole, or a range of its rows alone (quantized
    blocks run along a row, so rows dequantize on their own); a column range is cut after."""

    def __init__(self, tensor, hf_name: str, permute_heads_of: int | None) -> None:
        self.tensor, self.hf_name = tensor, hf_name
        self.shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        self.permute_heads_of = permute_heads_of  # q/k of a llama file: rows per head (head_dim)

    def read(self, cut: tuple[int, int, int] | None = None) -> torch.Tensor:
        from gguf import dequantize
        dim, start, stop = cut if cut is not None else (0, 0, self.shape[0])
        rows = (start, stop) if dim == 0 else (0, self.shape[0])
        data = self.tensor.data[rows[0]:rows[1]] if len(self.shape) > 1 else self.tensor.data
        w = np.asarray(dequantize(data, self.tensor.tensor_type), dtype=np.float32)
        w = w.reshape([rows[1] - rows[0], *self.shape[1:]] if len(self.shape) > 1 else self.shape)
        if self.permute_heads_of is not None:  # within each head: a slice of whole heads is fine
            w = _reverse_llama_permute(w, w.shape[0] // self.permute_heads_of)
        elif self.hf_name.endswith("shared_expert_gate.weight") and w.ndim == 1:
            w = w[None, :]  # llama.cpp stores the [1, H] gate as [H]
        t = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
        # rows were cut while reading; a column range, or a 1-D tensor's (a bias), is cut here
        cut_here = cut is not None and (dim != 0 or len(self.shape) == 1)
        return t.narrow(dim, start, stop - start) if cut_here else t


def iter_gguf_weights(reader, cfg: ArchConfig) -> Iterator[tuple[str, _GgufTensor]]:
    """Yield (HF parameter name, tensor dequantized to fp32 on read) for every tensor of the file."""
    is_llama = _field(reader, "general.architecture") == "llama"
    for t in reader.tensors:
        stacked = _stacked_expert_name(t.name)
        if stacked is not None:  # [E, rows, cols]: one tensor per expert
            w = _GgufTensor(t, t.name, None).read()
            for e in range(w.shape[0]):
                yield stacked.format(e=e), w[e].clone()
            continue
        name = _hf_name(t.name)
        permute = is_llama and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight"))
        yield name, _GgufTensor(t, name, cfg.head_dim if permute else None)


def _stacked_expert_name(gguf_name: str) -> str | None:
    """blk.N.ffn_gate_exps.weight -> 'model.layers.N.mlp.experts.{e}.gate_proj.weight' (None: not one)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{{e}}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
    return None


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.N.kind.weight|bias
    if parts[0] != "blk" or parts[2] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
