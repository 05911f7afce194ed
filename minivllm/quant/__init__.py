"""Quantized weights: checkpoint formats (AWQ, GPTQ, compressed-tensors, FP8), the quantized
linear layer and its methods (config.py, layer.py, w4a16.py, fp8.py), the RTN quantizer that
writes those formats (export.py). Kernels live in minivllm/kernels/."""
