"""minivllm: a small, fast LLM inference and serving engine in the vLLM lineage."""

from minivllm.lora.request import LoRARequest
from minivllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from minivllm.pooling_params import PoolerConfig, PoolingParams
from minivllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "PoolingParams", "PoolerConfig",
           "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput", "BeamSearchSequence",
           "EmbeddingRequestOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; importing it lazily keeps `minivllm.core` importable without torch
    if name == "LLM":
        from minivllm.llm import LLM
        return LLM
    raise AttributeError(name)
