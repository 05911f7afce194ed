"""minivllm: a small, fast LLM inference and serving engine in the vLLM lineage."""

from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; importing it lazily keeps `minivllm.core` importable without torch
    if name == "LLM":
        from minivllm.llm import LLM
        return LLM
    raise AttributeError(name)
