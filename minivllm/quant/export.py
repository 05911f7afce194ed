"""Round-to-nearest quantization of an unquantized Hugging Face model into the checkpoint
formats the engine reads, with each format's exact packing (quant/w4.py describes them):

    awq          AutoAWQ GEMM: asymmetric, qweight/qzeros packed along N in AWQ's order
    gptq         GPTQ v1: symmetric (sym=True), qweight packed along K, qzeros store zero - 1
    gptq-asym    the same, asymmetric
    gptq-act     the same, act-order (desc_act): g_idx from a column order (largest norm first,
                 standing in for GPTQ's Hessian order), groups are sets of input columns
    ct-w4a16     compressed-tensors pack-quantized, symmetric (packed by the compressed-tensors
                 library itself: the format's reference implementation)
    ct-w4a16-asym  the same, asymmetric (packed zero points)
    ct-fp8       compressed-tensors float-quantized: e4m3 weights, per-channel scales, dynamic
                 per-token activations
    fp8          vLLM's `fp8` checkpoint: e4m3 weights with one scale per tensor

RTN, not AWQ's or GPTQ's search: the files are for format and loading tests, and a quality
baseline. `dequantized_state` gives the float32 weights the quantized ones stand for (the oracle
model: load it unquantized and its greedy tokens must match the quantized model's).

scripts/quantize_default_model.py writes all of them for the bundled SmolLM2-135M (group size
64: its 576-wide inputs are not a multiple of 128).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from minivllm.quant import w4
from minivllm.quant.config import FP8_E4M3_MAX

FORMATS = ("awq", "gptq", "gptq-asym", "gptq-act", "ct-w4a16", "ct-w4a16-asym", "ct-fp8", "fp8")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class W4Quantized:
    """One linear's RTN result: W[n, k] ~ (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)]."""

    q: torch.Tensor  # [N, K] int64 in 0..15
    scales: torch.Tensor  # [N, K/G] float16 (the checkpoint's dtype)
    zeros: torch.Tensor  # [N, K/G] int64 in 0..15 (8 when symmetric)
    g_idx: torch.Tensor  # [K] int64: the group of each input column

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx
        return (self.q.float() - self.zeros[:, g].float()) * self.scales[:, g].float()


def rtn_w4(w: torch.Tensor, group_size: int, sym: bool, col_norms: torch.Tensor | None = None) -> W4Quantized:
    """Round-to-nearest 4-bit of w [N, K] in groups of input columns: consecutive ones, or with
    col_norms ([K], act-order) the columns in order of decreasing col_norms."""
    n, k = w.shape
    w = w.float()
    perm = torch.argsort(col_norms, descending=True, stable=True) if col_norms is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group_size
    wp = w[:, perm].view(n, k // group_size, group_size)
    if sym:
        scales = (2 * wp.abs().amax(-1) / 15).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15).long()
    qp = torch.round(wp / scales.float()[..., None]) + zeros[..., None]
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, perm] = qp.clamp(0, 15).long().view(n, k)
    return W4Quantized(q, scales, zeros, g_idx)


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from minivllm.quant.fp8 import quantize_rows
    w_q, scale = quantize_rows(w.float())
    return w_q, scale  # [N, K] e4m3, [N, 1] float32


def fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from minivllm.quant.fp8 import to_fp8
    scale = (w.abs().max().float() / FP8_E4M3_MAX).clamp(min=1e-12).reshape(())
    return to_fp8(w, scale), scale


def _awq_tensors(r: W4Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": w4.pack_awq(r.q.t()), "qzeros": w4.pack_awq(r.zeros.t()), "scales": r.scales.t().contiguous()}


def _gptq_tensors(r: W4Quantized) -> dict[str, torch.Tensor]:
    # v1 checkpoints store zero - 1 (wrapping 0 to 15, as GPTQ's int packing does)
    return {"qweight": w4.pack_int4(r.q.t(), 0), "qzeros": w4.pack_int4((r.zeros.t() - 1) & 0xF, 1),
            "scales": r.scales.t().contiguous(), "g_idx": r.g_idx.to(torch.int32)}


def _ct_pack(signed: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors' int4 packing of signed values (stored + 8, in order along `dim`): the
    library's own packer where it is installed, else the same packing here (equal: tests/unit/test_quant.py)."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        return w4.pack_int4(signed + 8, dim)
    return pack_to_int32(signed.to(torch.int8), 4, packed_dim=dim)


def _ct_w4_tensors(r: W4Quantized, sym: bool) -> dict[str, torch.Tensor]:
    out = {"weight_packed": _ct_pack(r.q - 8, 1), "weight_scale": r.scales, "weight_shape": torch.tensor(list(r.q.shape))}
    if not sym:
        out["weight_zero_point"] = _ct_pack(r.zeros - 8, 0)
    return out


def quantize_linear(w: torch.Tensor, fmt: str, group_size: int, col_norms: torch.Tensor | None = None
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear weight [N, K] -> (its checkpoint tensors in `fmt`, the float32 weight they stand
    for). col_norms: act-order's column ranking (gptq-act), shared by the layers of one input."""
    if fmt in ("ct-fp8", "fp8"):
        w_q, scale = fp8_per_channel(w) if fmt == "ct-fp8" else fp8_per_tensor(w)
        deq = w_q.float() * scale
        return {"weight": w_q, "weight_scale": scale}, deq
    sym = fmt in ("gptq", "gptq-act", "ct-w4a16")
    r = rtn_w4(w, group_size, sym, col_norms if fmt == "gptq-act" else None)
    if fmt == "awq":
        tensors = _awq_tensors(r)
    elif fmt.startswith("gptq"):
        tensors = _gptq_tensors(r)
    else:
        tensors = _ct_w4_tensors(r, sym)
    return tensors, r.dequantize()


def quantization_config(fmt: str, group_size: int) -> dict:
    """The config.json `quantization_config` each format's own tools write."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": fmt != "gptq-asym",
                "desc_act": fmt == "gptq-act", "checkpoint_format": "gptq"}
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "is_checkpoint_fp8_serialized": True}
    if fmt == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        return _ct_config("float-quantized", weights, acts)
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
               "symmetric": fmt == "ct-w4a16", "dynamic": False}
    return _ct_config("pack-quantized", weights, None)


def _ct_config(fmt: str, weights: dict, acts: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"]}


def quantized_state(state: dict[str, torch.Tensor], fmt: str, group_size: int
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An HF state dict -> (the quantized checkpoint's tensors, the dequantized float32 state:
    the oracle). Decoder linears are quantized; everything else is kept as it is."""
    out, deq = {}, {}
    for name, t in state.items():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            prefix = name[: -len(".weight")]
            tensors, d = quantize_linear(t, fmt, group_size, _input_col_norms(state, name))
            out.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
            deq[name] = d.contiguous()
        else:
            out[name] = deq[name] = t.contiguous()
    return out, deq


_SAME_INPUT = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
               "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
               "up_proj": ("gate_proj", "up_proj")}


def _input_col_norms(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Column norms over every linear reading the same input as `name` (q, k, v; gate, up): GPTQ's
    act-order ranks a layer's input features by its input's Hessian, shared by those layers, so
    their g_idx agree (the engine fuses them and checks that they do)."""
    parts = name.split(".")
    siblings = _SAME_INPUT.get(parts[-2], (parts[-2],))
    ws = [state[".".join(parts[:-2] + [s, "weight"])].float() for s in siblings]
    return torch.cat(ws, 0).norm(dim=0)


def write_checkpoint(out_dir: str, config: dict, state: dict[str, torch.Tensor], tokenizer=None,
                     quant_cfg: dict | None = None) -> str:
    """config.json (with quant_cfg as quantization_config), model.safetensors, the tokenizer."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    if quant_cfg is not None:
        cfg["quantization_config"] = quant_cfg
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def load_hf_model(gguf_path: str):
    """The bundled GGUF through transformers: (float32 state dict, config dict, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    state, cfg = hf_state_and_config(model)
    return state, cfg, AutoTokenizer.from_pretrained(d, gguf_file=f)


def hf_state_and_config(model) -> tuple[dict[str, torch.Tensor], dict]:
    """A float32 transformers model -> (its state dict, copied; its config as config.json holds it)."""
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state, cfg


def write_all(gguf_path: str, out_dir: str, formats: tuple[str, ...] = FORMATS, group_size: int = 64) -> dict[str, str]:
    """Writes out_dir/<fmt> for each format and out_dir/<fmt>-dequantized (its oracle: the same
    model unquantized, with the dequantized weights), plus out_dir/fp32 (the source). Returns
    {name: directory}."""
    state, cfg, tok = load_hf_model(gguf_path)
    dirs = {"fp32": write_checkpoint(os.path.join(out_dir, "fp32"), cfg, state, tok)}
    for fmt in formats:
        q, deq = quantized_state(state, fmt, group_size)
        dirs[fmt] = write_checkpoint(os.path.join(out_dir, fmt), cfg, q, tok, quantization_config(fmt, group_size))
        dirs[f"{fmt}-dequantized"] = write_checkpoint(os.path.join(out_dir, f"{fmt}-dequantized"), cfg, deq, tok)
    return dirs
