"""Quantization settings: parsed from a checkpoint's `quantization_config` or forced with
`LLM(..., quantization=...)`, validated once (pure Python: no torch).

Schemes the engine runs:
- "w4a16": 4-bit integer weights, a float scale (and an optional integer zero point) per group
  of `group_size` input features, 16-bit activations. Checkpoints: AutoAWQ (`awq`), GPTQ
  (`gptq`, with or without act-order / g_idx, sym or asym), compressed-tensors `pack-quantized`.
- "fp8": e4m3 weights with a float32 scale per output channel (per-tensor checkpoint scales are
  expanded to channels), activations quantized per token at run time (dynamic). Checkpoints:
  `fp8` (vLLM / AutoFP8) and compressed-tensors `float-quantized`; or `quantization="fp8"` on a
  bf16/fp32 (or GGUF) model quantizes its weights while loading.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
W4_GROUP_SIZES = (32, 64, 128, -1)  # -1: one group over the whole input (per-channel scales)
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class QuantConfig:
    method: str  # the checkpoint's quant_method, or "fp8" for quantization at load time
    scheme: str  # "w4a16" | "fp8"
    group_size: int = -1  # w4a16: input features per scale; -1 = all of them
    zero_point: bool = True  # w4a16: asymmetric (an integer zero per group); False: zero = 8
    act_order: bool = False  # w4a16: rows carry a group index (GPTQ desc_act / g_idx)
    gptq_zero_offset: int = 0  # GPTQ v1 checkpoints store zero - 1: this is added back (1)
    fp8_serialized: bool = False  # fp8: weights are fp8 in the checkpoint (else quantized at load)
    ignore: tuple[str, ...] = ()  # module names (HF names) left unquantized, e.g. lm_head

    @property
    def layout(self) -> str:
        """The checkpoint tensor layout of a quantized linear: awq | gptq | ct-w4 | fp8 | fp8-online."""
        if self.scheme == "fp8":
            return "fp8" if self.fp8_serialized else "fp8-online"
        return {"awq": "awq", "gptq": "gptq"}.get(self.method, "ct-w4")


def _err(model: str, setting: str, msg: str) -> ValueError:
    return ValueError(f"model {model!r}: {setting} {msg}")


def resolve_quant_config(hf_qc: dict | None, quantization: str | None, model: str) -> QuantConfig | None:
    """The engine's QuantConfig from the checkpoint's quantization_config (None: unquantized) and
    the user's `quantization` (None: follow the checkpoint). Raises ValueError naming the model
    and the setting for anything the engine cannot run."""
    if quantization is not None and quantization not in METHODS:
        raise _err(model, "quantization", f"must be one of {list(METHODS)} or None, got {quantization!r}")
    if not hf_qc:
        if quantization == "fp8":
            return QuantConfig("fp8", "fp8", fp8_serialized=False, ignore=("lm_head",))
        if quantization is not None:
            raise _err(model, "quantization", f"is {quantization!r} but the checkpoint has no quantization_config "
                       "(only 'fp8' can quantize an unquantized model at load time)")
        return None
    method = hf_qc.get("quant_method")
    if method not in METHODS:
        raise _err(model, "quantization_config.quant_method", f"{method!r} is not supported (supported: {list(METHODS)})")
    if quantization is not None and quantization != method:
        raise _err(model, "quantization", f"is {quantization!r} but the checkpoint's quant_method is {method!r}")
    if method == "awq":
        return _awq(hf_qc, model)
    if method == "gptq":
        return _gptq(hf_qc, model)
    if method == "fp8":
        return _fp8(hf_qc, model)
    return _compressed_tensors(hf_qc, model)


def _check_w4(bits: int, group_size: int, model: str, prefix: str) -> None:
    if bits != 4:
        raise _err(model, f"{prefix}bits", f"must be 4 (int4 weights), got {bits}")
    if group_size not in W4_GROUP_SIZES:
        raise _err(model, f"{prefix}group_size", f"{group_size} is not supported by the W4A16 kernels "
                   f"(supported: {list(W4_GROUP_SIZES)})")


def _awq(qc: dict, model: str) -> QuantConfig:
    bits, gs = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
    _check_w4(bits, gs, model, "quantization_config.")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _err(model, "quantization_config.version", f"{version!r} is not supported (supported: 'gemm')")
    return QuantConfig("awq", "w4a16", gs, bool(qc.get("zero_point", True)),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict, model: str) -> QuantConfig:
    bits, gs = qc.get("bits", 4), qc.get("group_size", 128)
    _check_w4(bits, gs, model, "quantization_config.")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _err(model, "quantization_config.checkpoint_format", f"{fmt!r} is not supported (gptq, gptq_v2)")
    return QuantConfig("gptq", "w4a16", gs, not qc.get("sym", True), bool(qc.get("desc_act", False)),
                       gptq_zero_offset=1 if fmt == "gptq" else 0)


def _fp8(qc: dict, model: str) -> QuantConfig:
    if qc.get("weight_block_size"):
        raise _err(model, "quantization_config.weight_block_size",
                   f"{qc['weight_block_size']} (block-wise FP8) is not supported: per-tensor and per-channel only")
    return QuantConfig("fp8", "fp8", fp8_serialized=bool(qc.get("is_checkpoint_fp8_serialized", True)),
                       ignore=("lm_head",) + tuple(qc.get("ignored_layers") or ()))


def _compressed_tensors(qc: dict, model: str) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _err(model, "quantization_config.config_groups", f"must hold exactly one scheme, got {len(groups)}")
    (scheme,) = groups.values()
    w, act = scheme.get("weights") or {}, scheme.get("input_activations")
    ignore = tuple(qc.get("ignore") or ())
    setting = "quantization_config.config_groups"
    if w.get("type") == "float" and w.get("num_bits") == 8:
        if w.get("strategy") not in ("channel", "tensor"):
            raise _err(model, f"{setting}.weights.strategy", f"{w.get('strategy')!r} is not supported for FP8 "
                       "(channel, tensor)")
        if act is not None and (act.get("type") != "float" or act.get("num_bits") != 8):
            raise _err(model, f"{setting}.input_activations", f"{act} is not supported (FP8 or none)")
        return QuantConfig("compressed-tensors", "fp8", fp8_serialized=True, ignore=ignore)
    fmt = qc.get("format")
    if w.get("type") != "int" or fmt != "pack-quantized" or act is not None:
        raise _err(model, setting, f"(format {fmt!r}, weights {w}, input_activations {act}) is not supported: "
                   "W4A16 pack-quantized or FP8 weights only")
    strategy = w.get("strategy")
    gs = -1 if strategy == "channel" else w.get("group_size")
    if strategy not in ("group", "channel"):
        raise _err(model, f"{setting}.weights.strategy", f"{strategy!r} is not supported (group, channel)")
    _check_w4(w.get("num_bits"), gs, model, f"{setting}.weights.")
    act_order = w.get("actorder") in ("group", "weight")
    return QuantConfig("compressed-tensors", "w4a16", gs, not w.get("symmetric", True), act_order, ignore=ignore)


def is_ignored(cfg: QuantConfig, hf_module_name: str) -> bool:
    """Whether the (HF-named) module, e.g. 'model.layers.0.self_attn.q_proj', stays unquantized."""
    for pat in cfg.ignore:
        if pat.startswith("re:"):
            import re
            if re.match(pat[3:], hf_module_name):
                return True
        elif hf_module_name == pat or hf_module_name.endswith("." + pat) or hf_module_name.split(".")[-1] == pat:
            return True
    return False
