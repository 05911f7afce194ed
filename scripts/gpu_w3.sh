#!/usr/bin/env bash
# W3 (BENCHMARKS.md) on the GPU machine: start one OpenAI-compatible server (ours or vLLM) with
# Qwen3-8B shapes and dummy weights, run `minivllm bench serve` at the given rates (1,000
# requests each), write one JSON per rate into $OUT, stop the server.
# Usage: gpu_w3.sh ours|vllm RATE [RATE ...]      (RATE: requests/s, or inf)
# OURS_FLAGS / VLLM_FLAGS add server options (e.g. "-tp 2", "-dp 2"); MODEL_CONFIG (qwen3-8b),
# PORT (8000), NUM_REQUESTS (1000) and LABEL (the engine name; names the output files) let several
# servers run side by side on different GPUs (scripts/gpu_multi.sh); MINIVLLM_STEP_LOG=<file>
# makes the engine core log every step's host phases.
set -u
ENGINE=$1; shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/vllm-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
OUTDIR=${OUT:-/tmp/w3}; mkdir -p "$OUTDIR"
# our server's own wheels (fastapi, uvicorn, pydantic, ...; folder .serve/, ~3 MB) when vLLM
# was not staged: carry ".serve" in the same call
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null && [ -d .serve ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vllm-site .serve/*.whl
fi
CFG=${MODEL_CONFIG:-qwen3-8b}; PORT=${PORT:-8000}; N=${NUM_REQUESTS:-1000}; LABEL=${LABEL:-$ENGINE}
MODEL=$(mktemp -d /tmp/w3-$CFG-XXXX)
cp minivllm/bench/configs/$CFG/config.json "$MODEL/"
if [ "$ENGINE" = ours ]; then
  python3 -m minivllm serve --model "$MODEL" --load-format dummy --max-model-len 4096 --port $PORT \
    --served-model-name $CFG --skip-tokenizer-init --uvicorn-log-level warning ${OURS_FLAGS:-} > "$OUTDIR/server_$LABEL.log" 2>&1 &
else
  python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" --load-format dummy --max-model-len 4096 \
    --port $PORT --served-model-name $CFG --skip-tokenizer-init --no-enable-log-requests ${VLLM_FLAGS:-} \
    > "$OUTDIR/server_$LABEL.log" 2>&1 &
fi
SERVER=$!
t0=$SECONDS
until curl -sf http://127.0.0.1:$PORT/health >/dev/null 2>&1; do
  sleep 1
  if ! kill -0 $SERVER 2>/dev/null; then echo "server died"; tail -30 "$OUTDIR/server_$LABEL.log"; exit 1; fi
  if [ $((SECONDS - t0)) -gt 240 ]; then echo "server not up in 240 s"; tail -30 "$OUTDIR/server_$LABEL.log"; exit 1; fi
done
echo "[$LABEL] server up in $((SECONDS - t0)) s"
for RATE in "$@"; do
  python3 -m minivllm.server.bench_serve --base-url http://127.0.0.1:$PORT --model $CFG --num-requests $N \
    --request-rate "$RATE" --seed 0 --engine-label "$LABEL" --output-json "$OUTDIR/w3_${LABEL}_${RATE}.json" \
    2>&1 | tail -3
done
kill -TERM $SERVER; wait $SERVER
echo "[$LABEL] exit $?"
