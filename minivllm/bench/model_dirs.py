"""Model-config directories for dummy-weight benchmarks, and the byte counts of a model.

The exact Hugging Face config.json files of ../shared/model-configs are bundled in
minivllm/bench/configs/<name>/config.json (plus `tiny-llama` for CPU smoke tests and `smollm2-135m`, the
default model's shapes, for CPU timelines), because
../shared does not travel to the GPU machine. `write_model_dir(name)` copies one into a fresh
temporary directory, which minivllm, vLLM (`load_format="dummy"`, `skip_tokenizer_init=True`)
and transformers (`AutoConfig.from_pretrained`) all accept as a model directory;
`add_bundled_tokenizer(dir)` gives one the default model's tokenizer when an engine needs text.

Pure Python: importable from the vLLM process without torch or the minivllm engine.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# the default model's tokenizer (SmolLM2, 49,152 tokens): the one real tokenizer that reaches the
# GPU machine, for benchmarks whose engines need text (W7's grammars, vLLM's beam_search)
TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers", "smollm2")
BUNDLED_VOCAB, BUNDLED_EOS, BUNDLED_BOS = 49152, 2, 1  # <|im_end|>, <|im_start|>


def bundled_names() -> list[str]:
    return sorted(d for d in os.listdir(CONFIGS_DIR) if os.path.isfile(os.path.join(CONFIGS_DIR, d, "config.json")))


def config_path(name_or_path: str) -> str:
    """A bundled config name (qwen3-0.6b, qwen3-8b, qwen3-32b, llama-3.1-8b, tiny-llama), a
    directory holding config.json, or a config.json file."""
    if os.path.isfile(os.path.join(CONFIGS_DIR, name_or_path, "config.json")):
        return os.path.join(CONFIGS_DIR, name_or_path, "config.json")
    if os.path.isdir(name_or_path) and os.path.isfile(os.path.join(name_or_path, "config.json")):
        return os.path.join(name_or_path, "config.json")
    if os.path.isfile(name_or_path) and name_or_path.endswith(".json"):
        return name_or_path
    raise ValueError(f"model config {name_or_path!r} is neither a bundled name ({', '.join(bundled_names())}) "
                     "nor a directory holding config.json nor a .json file")


def load_config(name_or_path: str) -> dict:
    with open(config_path(name_or_path)) as f:
        return json.load(f)


def config_name(name_or_path: str) -> str:
    """A short label for reports: the bundled name, or the directory's name."""
    p = config_path(name_or_path)
    return os.path.basename(os.path.dirname(p)) or name_or_path


def awq_quantization_config(group_size: int = 128) -> dict:
    """AutoAWQ's quantization_config (int4, GEMM layout): both engines read it from config.json and
    fill the packed tensors with random values under load_format="dummy" (W11)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def write_model_dir(name_or_path: str, dest: str | None = None, quantization_config: dict | None = None) -> str:
    """Writes config.json (only) into dest or a new temporary directory and returns its path.
    quantization_config: written into it (an AWQ checkpoint's is float16, as AutoAWQ writes)."""
    cfg = load_config(name_or_path)
    if quantization_config is not None:
        cfg = dict(cfg, quantization_config=quantization_config)
        if quantization_config.get("quant_method") == "awq":
            cfg["torch_dtype"] = "float16"
    d = dest or tempfile.mkdtemp(prefix=f"minivllm-bench-{config_name(name_or_path)}-")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return d


def add_bundled_tokenizer(model_dir: str) -> int:
    """Gives a dummy model directory the bundled SmolLM2 tokenizer: its files, and a config whose
    vocab_size (and eos/bos) match it, so every id an engine samples decodes. The model's shapes
    are otherwise unchanged (a smaller embedding and LM head). Returns the new vocab_size."""
    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(vocab_size=BUNDLED_VOCAB, eos_token_id=BUNDLED_EOS, bos_token_id=BUNDLED_BOS)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(model_dir, name))
    with gzip.open(os.path.join(TOKENIZER_DIR, "tokenizer.json.gz"), "rb") as src, \
            open(os.path.join(model_dir, "tokenizer.json"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    return BUNDLED_VOCAB


def has_tokenizer(model_dir: str) -> bool:
    """Whether the engines should load a tokenizer from model_dir (else skip_tokenizer_init)."""
    return os.path.isfile(os.path.join(model_dir, "tokenizer.json"))


# ---- sizes ---------------------------------------------------------------------------------------
def _dims(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    return h, inter, layers, heads, kv, hd, cfg["vocab_size"]


def _moe_layers(cfg: dict, layers: int) -> list[bool]:
    """Which layers are sparse MoE (models/arch.py's MoEConfig.is_sparse_layer, in plain Python
    so the vLLM process can import this module)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return [False] * layers
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _moe_mlp(cfg: dict, h: int) -> tuple[int, int]:
    """(parameters of one sparse MLP block, of them read per token): router E x H, experts
    E x 3 H I (k of them per token), a shared expert 3 H I_s + its gate H."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or 0
    common = experts * h + (3 * h * shared + h if shared else 0)
    return common + experts * 3 * h * inter, common + cfg["num_experts_per_tok"] * 3 * h * inter


def param_counts(cfg: dict) -> dict[str, int]:
    """Parameters of a Llama/Qwen2/Qwen3 decoder (and their MoE variants) by part (biases and
    q/k norms included). layers_active: the layers' parameters one token reads (MoE: the
    router and top-k experts of each sparse layer, not every expert)."""
    h, inter, layers, heads, kv, hd, vocab = _dims(cfg)
    archs = cfg.get("architectures") or []
    qwen3 = cfg.get("model_type") in ("qwen3", "qwen3_moe") or any(a.startswith("Qwen3") for a in archs)
    bias = cfg.get("attention_bias", cfg.get("qkv_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe")))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if bias:
        attn += heads * hd + 2 * kv * hd
    if qwen3:
        attn += 2 * hd  # q_norm, k_norm
    dense = 3 * h * inter
    sparse = _moe_layers(cfg, layers)
    moe_all, moe_active = _moe_mlp(cfg, h) if any(sparse) else (0, 0)
    base = layers * (attn + 2 * h)  # + input and post-attention RMSNorm
    all_layers = base + sum(moe_all if s else dense for s in sparse)
    active = base + sum(moe_active if s else dense for s in sparse)
    embed = vocab * h
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    return {"embedding": embed, "layers": all_layers, "layers_active": active, "final_norm": h, "lm_head": lm_head,
            "total": embed + all_layers + h + lm_head}


def linear_params(cfg: dict) -> int:
    """Parameters of the decoder's linear layers (q, k, v, o, gate, up, down), every layer: the
    ones a quantized checkpoint stores quantized (dense decoders)."""
    h, inter, layers, heads, kv, hd, vocab = _dims(cfg)
    return layers * (h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter)


def quantized_linear_bytes(scheme: str | None, group_size: int = 128, dtype_bytes: int = 2) -> float:
    """Bytes per linear weight: int4 AWQ = 4 bits + a 16-bit scale and a 4-bit zero per group;
    FP8 = 1 byte (+ a per-channel scale, negligible); None = the model dtype."""
    if scheme == "awq":
        return 0.5 + (dtype_bytes + 0.5) / group_size
    return 1.0 if scheme == "fp8" else float(dtype_bytes)


def weight_bytes(cfg: dict, dtype_bytes: int = 2, linear_bytes: float | None = None) -> dict[str, int]:
    """total: every parameter; read_per_decode_step: what one batch-1 decode step streams from
    memory: every layer's attention and norms, dense MLPs, for each sparse MoE layer the router,
    the top-k experts (and a shared expert), the final norm and the LM head (the embedding
    table is read one row a token; a tied table is read whole by the LM head). linear_bytes:
    bytes per weight of the decoder's linear layers when they are quantized
    (quantized_linear_bytes); the rest stays in the model dtype."""
    c = param_counts(cfg)
    read = c["layers_active"] + c["final_norm"] + (c["lm_head"] if c["lm_head"] else c["embedding"])
    saved = 0 if linear_bytes is None else linear_params(cfg) * (dtype_bytes - linear_bytes)
    return {"total": int(c["total"] * dtype_bytes - saved), "read_per_decode_step": int(read * dtype_bytes - saved)}


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    h, inter, layers, heads, kv, hd, vocab = _dims(cfg)
    return 2 * layers * kv * hd * dtype_bytes  # K and V, every layer


def decode_roofline(cfg: dict, prompt_len: int, output_len: int, bandwidth_bytes_per_s: float,
                    dtype_bytes: int = 2, linear_bytes: float | None = None, kv_dtype_bytes: int | None = None) -> dict:
    """The memory roofline of one batch-1 decode step of W2 (and W10-decode): (weight bytes read +
    the KV bytes of the mean context over the decode steps) / measured copy bandwidth (read +
    write bytes / s). For a MoE model the weights read are the active ones (weight_bytes).
    linear_bytes / kv_dtype_bytes: quantized linears (W11) and KV cache."""
    wb = weight_bytes(cfg, dtype_bytes, linear_bytes)
    # decode steps produce tokens 2..output_len; the step producing token j attends to prompt + j - 1
    steps = max(output_len - 1, 1)
    mean_ctx = prompt_len + (output_len) / 2
    kv = kv_bytes_per_token(cfg, kv_dtype_bytes or dtype_bytes) * mean_ctx
    return {
        "weight_bytes_total": wb["total"], "weight_bytes_read_per_step": wb["read_per_decode_step"],
        "kv_bytes_per_step_mean": kv, "decode_steps": steps, "copy_bandwidth_Bps": bandwidth_bytes_per_s,
        "roofline_ms": 1e3 * (wb["read_per_decode_step"] + kv) / bandwidth_bytes_per_s,
        "roofline_ms_all_weights": 1e3 * (wb["total"] + kv) / bandwidth_bytes_per_s,
    }
