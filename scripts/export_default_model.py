"""Export the bundled SmolLM2-135M-Instruct (GGUF) to a Hugging Face directory, for engines and
benchmarks that want one (W8, vLLM): weights in the chosen dtype plus the tokenizer; with
--num-layers N, a copy keeping only the first N layers (a smaller draft model with the same
tokenizer for speculative decoding).

    python scripts/export_default_model.py OUT_DIR [--dtype bfloat16] [--num-layers N]
"""

from __future__ import annotations

import argparse
import os

import torch


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minivllm.models.source import default_gguf_path
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-layers", type=int, default=None)
    args = p.parse_args(argv)
    gguf = default_gguf_path()
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, args.dtype))
    if args.num_layers is not None:
        model.model.layers = model.model.layers[:args.num_layers]
        model.config.num_hidden_layers = args.num_layers
    # transformers marks a model loaded from GGUF as quantized with GGUF (its tensors are
    # de-quantized on load) and, in some versions (5.17 on the GPU machine), refuses to save it:
    # the weights in memory are plain tensors of the chosen dtype, so drop the mark
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(args.out)
    print(f"wrote {args.out} ({model.config.num_hidden_layers} layers, {args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
