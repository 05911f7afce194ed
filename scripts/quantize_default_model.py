"""Write the bundled SmolLM2-135M-Instruct in every quantized checkpoint format the engine reads
(RTN with each format's exact packing; minivllm/quant/export.py), each beside its dequantized
float32 twin (the oracle), plus the float32 source as a Hugging Face directory.

    python scripts/quantize_default_model.py --out /tmp/smollm2-quant [--formats awq,gptq] [--group-size 64]
"""

from __future__ import annotations

import argparse

from minivllm.models.source import default_gguf_path
from minivllm.quant.export import FORMATS, write_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (one sub-directory per format)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--group-size", type=int, default=64, help="int4 group size (576-wide inputs: 32 or 64)")
    p.add_argument("--gguf", default=None, help="source GGUF (default: the bundled model)")
    args = p.parse_args()
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: unknown {bad}; known: {', '.join(FORMATS)}")
    for name, d in write_all(args.gguf or default_gguf_path(), args.out, formats, args.group_size).items():
        print(f"{name}: {d}")


if __name__ == "__main__":
    main()
