"""Sampling: the batched sampler, its per-step tensors, and the logits transforms it uses."""

from minivllm.sample.batch import SamplingBatch, SamplingRequestState, validate_for_vocab
from minivllm.sample.ops import apply_penalties, apply_top_k_top_p_min_p
from minivllm.sample.sampler import HostSamplerOutput, Sampler, SamplerOutput, process_logits

__all__ = [
    "HostSamplerOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingRequestState",
    "apply_penalties",
    "apply_top_k_top_p_min_p",
    "process_logits",
    "validate_for_vocab",
]
