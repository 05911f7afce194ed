#!/usr/bin/env bash
# The README's quick start in one command: install everything into ./.venv, then answer.
#   bash scripts/quickstart.sh "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/minivllm generate "${@:-What is the capital of France?}"
