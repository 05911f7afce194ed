#!/usr/bin/env bash
# W7 on the GPU machine, from the repository root (see scripts/gpu_w7.py and scripts/vllm_carry.md):
# stages vLLM pieces carried in this call, makes xgrammar importable for minivllm, then runs
# both engines (extra flags go to gpu_w7.py, e.g. --engine minivllm). Results on stdout and in
# $OUT/w7.txt.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .vllm ]; then bash scripts/vllm_stage.sh || echo "gpu_w7: vLLM staging failed"; fi
bash scripts/xgrammar_stage.sh || echo "gpu_w7: xgrammar staging failed (minivllm's constrained runs will fail)"
# (--engine minivllm runs in this process's environment: the staged site must be on its path;
# lease 10's first w7-timeline failed without it)
export PYTHONPATH=${XGR_SITE:-/tmp/xgr-site}${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
python3 scripts/gpu_w7.py "$@" 2>&1 | tee "${OUT:-/tmp}/w7.txt"
