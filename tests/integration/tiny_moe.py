"""Tiny random mixture-of-experts models built with transformers (the oracle), saved as Hugging
Face directories or written as GGUF files, for the MoE tests (CPU here, bf16 in tests/gpu)."""

from __future__ import annotations

import numpy as np
import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
# kind -> (config class, model class, the kind's own config fields); each exercises a flag:
# qwen3_moe: q/k-norm, norm_topk_prob, a dense layer among sparse ones (mlp_only_layers);
# mixtral: always-renormalised top-k, w1/w2/w3 names; qwen2_moe: shared expert, qkv bias,
# decoder_sparse_step, no renormalisation
KINDS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=48)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2, norm_topk_prob=False)),
}
PROMPTS = [[1, 5, 9, 33, 2, 7], [100, 3, 4], list(range(10, 50)), [7] * 20 + [200, 201]]


def build(kind: str, path: str | None = None, seed: int = 0, **overrides):
    """A random HF model of `kind` in fp32 (weights ~N(0, 0.2): the greedy tokens vary and their
    margins stay well above fp32 noise), saved to `path` when given."""
    import transformers
    cfg_name, model_name, own = KINDS[kind]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **own, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            else:  # norms and biases: near their usual values, not exactly
                p.add_(torch.randn_like(p) * 0.05)
    if path is not None:
        model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The argmax of the full forward, token after token (no generate(): its logits processors
    would hide eos, which minivllm with ignore_eos may still pick)."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(p):])
    return out


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log_softmax of the logits that predicted each token of `continuation`: [len, V]."""
    ids = torch.tensor([prompt + continuation], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


# ---- GGUF (llama.cpp's tensor names and metadata keys) -----------------------------------------
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def _llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q/k rows for the llama arch."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, kind: str, path: str) -> None:
    """The HF model as an F32 GGUF file, expert tensors stacked as llama.cpp writes them."""
    import gguf
    cfg, arch = model.config, _GGUF_ARCH[kind]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, t in _gguf_tensors(model, kind):
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight",
               "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
               "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
               "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
               "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}


def _gguf_tensors(model, kind: str):
    cfg = model.config
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", a
        elif name == "model.norm.weight":
            yield "output_norm.weight", a
        elif name == "lm_head.weight":
            yield "output.weight", a
        else:
            _, _, i, rest = name.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
                inter = a.shape[1] // 2
                yield f"blk.{i}.ffn_gate_exps.weight", a[:, :inter]
                yield f"blk.{i}.ffn_up_exps.weight", a[:, inter:]
            elif rest == "mlp.experts.down_proj":
                yield f"blk.{i}.ffn_down_exps.weight", a
            else:
                if kind == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                    heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
                    a = _llama_permute(a, heads)
                if rest == "mlp.shared_expert_gate.weight":
                    a = a.reshape(-1)  # llama.cpp keeps this [1, H] gate as [H]
                yield f"blk.{i}.{_GGUF_LAYER[rest]}", a
