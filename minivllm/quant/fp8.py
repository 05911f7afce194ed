"""FP8 (e4m3) weights with a float32 scale per output channel, activations quantized per token
at run time (dynamic scales): checkpoints in `fp8` or compressed-tensors `float-quantized` form,
or `quantization="fp8"` on an unquantized model (weights quantized while loading).

    w_q[n, :] = clamp(W[n, :] / s_w[n]),  s_w[n] = max|W[n, :]| / 448
    x_q[m, :] = clamp(x[m, :] / s_x[m]),  s_x[m] = max|x[m, :]| / 448
    y[m, n]   = s_x[m] s_w[n] sum_k x_q[m, k] w_q[n, k]

On a GPU with FP8 (compute capability >= 8.9) the product runs on torch._scaled_mm with row-wise
scales (kernels/fp8_gemm.py); the functions here are its plain-PyTorch reference, which the CPU
runs (FP8 storage and conversion work on the CPU, the arithmetic is float32).
"""

from __future__ import annotations

import torch

from minivllm.quant.config import FP8_E4M3_MAX, QuantConfig
from minivllm.quant.layer import QuantLinear, new_param

FP8 = torch.float8_e4m3fn
MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)  # an all-zero row still gets a finite scale


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturated at +-448 (torch's cast alone would give NaN beyond)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] fp8, scales [M, 1] float32): one scale per row (token or channel)."""
    scale = (x.abs().amax(-1, keepdim=True).float() / FP8_E4M3_MAX).clamp_(min=MIN_SCALE)
    return to_fp8(x, scale), scale


def fp8_linear_reference(x, w_q: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, w_dequant: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (quantized per token here; or rows already quantized, kernels/fp8_gemm.Fp8Rows
    [T, K]) @ (w_q [N, K] * w_scale [N]).T (+ bias), in float32, returned in x's dtype.
    w_dequant: that product of w_q and w_scale when already computed (float32 [N, K])."""
    if isinstance(x, torch.Tensor):
        lead, dtype = x.shape[:-1], x.dtype
        x_q, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    else:
        lead, dtype, x_q, x_scale = x.q.shape[:-1], x.dtype, x.q, x.scale
    w = w_dequant if w_dequant is not None else w_q.float() * w_scale.float()[:, None]
    y = (x_q.float() * x_scale) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).view(*lead, w_q.shape[0])


class Fp8Method:
    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant

    def create_weights(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        if self.quant.fp8_serialized:
            new_param(layer, "weight", (n, k), FP8)
            new_param(layer, "weight_scale", (n,), torch.float32, fill_scalar=True)
        else:  # quantized after loading
            new_param(layer, "weight", (n, k), torch.get_default_dtype())

    def init_dummy(self, layer: QuantLinear, gen: torch.Generator) -> None:
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=layer.weight.device)
        w.uniform_(-0.02, 0.02, generator=gen)
        if self.quant.fp8_serialized:
            layer.weight.data.copy_(to_fp8(w, torch.tensor(0.02 / FP8_E4M3_MAX, device=w.device)))
            layer.weight_scale.data.fill_(0.02 / FP8_E4M3_MAX)
        else:
            layer.weight.data.copy_(w)
        if layer.bias is not None:
            layer.bias.data.zero_()

    def process_after_loading(self, layer: QuantLinear) -> None:
        if self.quant.fp8_serialized:
            w_q, w_scale = layer.weight.data, layer.weight_scale.data
        else:
            w_q, w_scale = quantize_rows(layer.weight.data)
            w_scale = w_scale.view(-1)
        del layer.weight
        if hasattr(layer, "weight_scale"):
            del layer.weight_scale
        layer.register_buffer("weight_fp8", w_q.contiguous(), persistent=False)  # [N, K]
        layer.register_buffer("weight_scale_f32", w_scale.float().contiguous(), persistent=False)  # [N]
        if w_q.device.type == "cpu":  # the reference's weight, dequantized once (exact in float32)
            layer.weight_dequant = w_q.float() * layer.weight_scale_f32[:, None]

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        # x may come quantized already (kernels/fp8_act.py's Fp8Rows)
        if (x if isinstance(x, torch.Tensor) else x.q).device.type == "cuda":
            from minivllm.kernels.fp8_gemm import fp8_linear
            return fp8_linear(x, layer.weight_fp8, layer.weight_scale_f32, layer.bias)
        return fp8_linear_reference(x, layer.weight_fp8, layer.weight_scale_f32, layer.bias,
                                    getattr(layer, "weight_dequant", None))
