"""W4A16: 4-bit weights in groups (AWQ, GPTQ, compressed-tensors pack-quantized), 16-bit activations.

The parameters are created in the checkpoint's own layout (quant/w4.py describes each), loaded
shard by shard, then converted once to the engine's layout: qweight [K/8, N] int32 packed along
K, float scales and zeros [K/G, N], an optional act-order row permutation. On a GPU the product
runs on the Triton kernel (kernels/w4a16_gemm.py, dequantizing in registers); on the CPU the
layer keeps the dequantized weight (`dense_weight`) and becomes a plain nn.Linear
(quant/layer.py: process_quantized_layers).
"""

from __future__ import annotations

import torch

from minivllm.quant import w4
from minivllm.quant.config import QuantConfig
from minivllm.quant.layer import QuantLinear, new_param


class W4A16Method:
    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant

    def _groups(self, layer: QuantLinear) -> tuple[int, int]:
        """(group size, number of groups); raises for shapes the format or kernels cannot take."""
        k, g = layer.in_features, self.quant.group_size
        g = k if g == -1 else g
        bad = [s for s in layer.output_sizes if s % 8]
        if k % g or k % 8 or bad:
            raise ValueError(f"layer {layer.name}: in_features {k} and output sizes {layer.output_sizes} do not fit "
                             f"quantization_config group_size {self.quant.group_size} (in_features must be a multiple of the group size "
                             "and of 8, every output size a multiple of 8)")
        return g, k // g

    def create_weights(self, layer: QuantLinear) -> None:
        k, n, dt = layer.in_features, layer.out_features, torch.get_default_dtype()
        _, ng = self._groups(layer)
        i32 = torch.int32
        if self.quant.layout == "awq":
            new_param(layer, "qweight", (k, n // 8), i32, output_dim=1, pack_factor=8)
            new_param(layer, "scales", (ng, n), dt, output_dim=1)
            if self.quant.zero_point:
                new_param(layer, "qzeros", (ng, n // 8), i32, output_dim=1, pack_factor=8)
        elif self.quant.layout == "gptq":
            new_param(layer, "qweight", (k // 8, n), i32, output_dim=1)
            new_param(layer, "scales", (ng, n), dt, output_dim=1)
            new_param(layer, "qzeros", (ng, n // 8), i32, output_dim=1, pack_factor=8)
            new_param(layer, "g_idx", (k,), i32, output_dim=None, shared=True, optional=True)
        else:  # compressed-tensors pack-quantized
            new_param(layer, "weight_packed", (n, k // 8), i32)
            new_param(layer, "weight_scale", (n, ng), dt)
            if self.quant.zero_point:
                new_param(layer, "weight_zero_point", (n // 8, ng), i32, pack_factor=8)
            if self.quant.act_order:
                new_param(layer, "weight_g_idx", (k,), i32, output_dim=None, shared=True, optional=True)

    def init_dummy(self, layer: QuantLinear, gen: torch.Generator) -> None:
        """Random 4-bit values, zeros 8 and scales of 0.0025: weights in [-0.02, 0.0175] (as the
        dummy bf16 weights' +-0.02), so activations stay finite."""
        for name, p in layer.named_parameters():
            if name == "bias":
                p.data.zero_()
            elif p.dtype == torch.int32 and name.endswith("g_idx"):
                continue  # left unloaded: no act-order
            elif p.dtype == torch.int32 and "zero" in name:
                p.data.fill_(_packed_eights(self.quant.layout))
            elif p.dtype == torch.int32:
                p.data.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, device=p.device,
                                           dtype=torch.int64).to(torch.int32))
            else:
                p.data.fill_(0.0025)

    def process_after_loading(self, layer: QuantLinear) -> None:
        """Checkpoint tensors -> the engine's layout (then dropped)."""
        g, _ = self._groups(layer)
        qweight, scales, zeros, perm = _to_engine_layout(layer, self.quant, g)
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            delattr(layer, name)
        layer.group_size = g
        if qweight.device.type == "cpu":
            layer.dense_weight = w4.dequantize(qweight, scales, zeros, g, perm, dtype=scales.dtype)
            return
        from minivllm.kernels.w4a16_gemm import gemv_scale_zero_layout
        scales, zeros = gemv_scale_zero_layout(scales, zeros)  # (each scale and zero one word for the GEMV)
        layer.register_buffer("qweight", qweight, persistent=False)
        layer.register_buffer("scales", scales, persistent=False)
        layer.register_buffer("zeros", zeros, persistent=False)
        layer.perm = perm

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "dense_weight", None) is not None:
            return torch.nn.functional.linear(x, layer.dense_weight, layer.bias)
        from minivllm.kernels.w4a16_gemm import w4a16_linear
        return w4a16_linear(x, layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.perm, layer.bias)


def _packed_eights(layout: str) -> int:
    """The int32 word of eight zero points that dequantize to zero at q = 8 (dummy weights)."""
    stored = 7 if layout == "gptq" else 8  # GPTQ v1 stores zero - 1; ct stores z + 8 with z = 0
    word = sum(stored << (4 * j) for j in range(8))
    return word - 2**32 if word >= 2**31 else word


def _to_engine_layout(layer: QuantLinear, quant: QuantConfig, g: int):
    """-> (qweight [K/8, N] int32, scales [K/G, N], zeros [K/G, N] float, perm [K] int64 | None)."""
    k = layer.in_features
    if quant.layout == "awq":
        q = w4.unpack_awq(layer.qweight.data)  # [K, N]
        scales = layer.scales.data
        zeros = w4.unpack_awq(layer.qzeros.data) if quant.zero_point else torch.full_like(scales, 8)
        return w4.pack_engine(q), scales.contiguous(), zeros.to(scales.dtype).contiguous(), None
    if quant.layout == "gptq":
        scales = layer.scales.data
        zeros = (w4.unpack_int4(layer.qzeros.data, 1) + quant.gptq_zero_offset) & 0xF if quant.zero_point else None
        if zeros is None:  # symmetric: the stored zeros are 8 (7 in v1 files); use 8 whatever they hold
            zeros = torch.full_like(scales, 8)
        qweight, g_idx = w4.pack_engine(w4.unpack_int4(layer.qweight.data, 0)), layer.g_idx  # GPTQ: rows in order
        perm = w4.group_perm(g_idx.data, g, k) if getattr(g_idx, "loaded", False) else None
    else:
        scales = layer.weight_scale.data.t()
        zeros = (w4.unpack_int4(layer.weight_zero_point.data, 0).t() if quant.zero_point
                 else torch.full_like(scales, 8))
        qweight = w4.pack_engine(w4.unpack_int4(layer.weight_packed.data, 1).t())
        g_idx = getattr(layer, "weight_g_idx", None)
        perm = w4.group_perm(g_idx.data, g, k) if g_idx is not None and getattr(g_idx, "loaded", False) else None
    if perm is not None:
        qweight = w4.pack_engine(w4.unpack_engine(qweight)[perm])
        perm = perm.contiguous()
    return qweight.contiguous(), scales.contiguous(), zeros.to(scales.dtype).contiguous(), perm
