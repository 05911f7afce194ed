#!/usr/bin/env bash
# The one command for the GPU machine (run from the repository root):
#
#   bash scripts/gpu_bench.sh --only ours:W1,vllm:W1 [more minivllm.bench.compare flags]
#
# 1. stages/installs any vLLM pieces this call carried (scripts/vllm_stage.sh; see
#    scripts/vllm_carry.md), 2. runs python3 -m minivllm.bench.compare with results in $OUT
#    (results.jsonl, driver.log, summary.txt) and a budget of BENCH_BUDGET_S (default 560 s)
#    minus the time staging took, so the whole call stays inside one 10-minute device command.
#    Pass --budget-s yourself to override. `--list` lists the jobs.
set -u
cd "$(dirname "$0")/.."
BUDGET=${BENCH_BUDGET_S:-560}
export PYTHONUNBUFFERED=1
# wheels carried in .whl (e.g. gguf) for minivllm: installed into /tmp/site, on PYTHONPATH
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d .vllm ]; then bash scripts/vllm_stage.sh || echo "gpu_bench: vLLM staging failed (vLLM jobs will be skipped or fail)"; fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
left=$((BUDGET - SECONDS))
exec python3 -m minivllm.bench.compare --out "${OUT:-/tmp/minivllm-bench}" --budget-s "$left" "$@"
