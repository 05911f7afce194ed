#!/usr/bin/env bash
# W3 (BENCHMARKS.md) on the GPU machine: start one OpenAI-compatible server (ours or vLLM) with
# Qwen3-8B shapes and dummy weights, run `minivllm bench serve` at the given rates (1,000
# requests each), write one JSON per rate into $OUT, stop the server.
# Usage: gpu_w3.sh ours|vllm RATE [RATE ...]      (RATE: requests/s, or inf)
# OURS_FLAGS adds `minivllm serve` options; MINIVLLM_STEP_LOG=<file> makes the engine core log
# every step's host phases.
set -u
ENGINE=$1; shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/vllm-site:$PWD
OUTDIR=${OUT:-/tmp/w3}; mkdir -p "$OUTDIR"
# our server's own wheels (fastapi, uvicorn, pydantic, ...; folder .serve/, ~3 MB) when vLLM
# was not staged: carry ".serve" in the same call
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null && [ -d .serve ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vllm-site .serve/*.whl
fi
MODEL=$(mktemp -d /tmp/w3-qwen3-8b-XXXX)
cp minivllm/bench/configs/qwen3-8b/config.json "$MODEL/"
if [ "$ENGINE" = ours ]; then
  python3 -m minivllm serve --model "$MODEL" --load-format dummy --max-model-len 4096 --port 8000 \
    --served-model-name qwen3-8b --skip-tokenizer-init --uvicorn-log-level warning ${OURS_FLAGS:-} > "$OUTDIR/server_$ENGINE.log" 2>&1 &
else
  python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" --load-format dummy --max-model-len 4096 \
    --port 8000 --served-model-name qwen3-8b --skip-tokenizer-init --no-enable-log-requests \
    > "$OUTDIR/server_$ENGINE.log" 2>&1 &
fi
SERVER=$!
t0=$SECONDS
until curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1; do
  sleep 1
  if ! kill -0 $SERVER 2>/dev/null; then echo "server died"; tail -30 "$OUTDIR/server_$ENGINE.log"; exit 1; fi
  if [ $((SECONDS - t0)) -gt 240 ]; then echo "server not up in 240 s"; tail -30 "$OUTDIR/server_$ENGINE.log"; exit 1; fi
done
echo "[$ENGINE] server up in $((SECONDS - t0)) s"
for RATE in "$@"; do
  python3 -m minivllm.server.bench_serve --base-url http://127.0.0.1:8000 --model qwen3-8b --num-requests 1000 \
    --request-rate "$RATE" --seed 0 --engine-label "$ENGINE" --output-json "$OUTDIR/w3_${ENGINE}_${RATE}.json" \
    2>&1 | tail -3
done
kill -TERM $SERVER; wait $SERVER
echo "[$ENGINE] exit $?"
