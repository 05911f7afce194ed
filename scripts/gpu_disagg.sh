#!/usr/bin/env bash
# Disaggregated prefill/decode vs ordinary instances, W3 (BENCHMARKS.md) at RATE req/s with Qwen3-8B
# shapes and dummy weights (as gpu_w3.sh), p99 inter-token latency and TTFT:
#   single      one ordinary instance on GPU 0
#   pd_shared   a prefill and a decode instance sharing GPU 0 (gpu_memory_utilization split:
#               the prefill instance starts first with P_UTIL, then the decode one with D_UTIL, which
#               counts the prefill instance's memory as used) behind `minivllm router --prefill --decode`
# with NUM_GPUS=2 also:
#   pd_2gpu     prefill on GPU 0, decode on GPU 1 (it also sees GPU 0, so CUDA IPC maps the
#               prefill instance's KV: device-to-device copies) behind the router
#   dp_2gpu     two ordinary instances, GPU 0 and GPU 1, behind `minivllm router --instance`
# Usage: [NUM_GPUS=1|2] [NUM_REQUESTS=1000] [RATE=16] [MODES="single pd_shared ..."] [GPU_A=0 GPU_B=1]
#        scripts/gpu_disagg.sh
# Output in $OUT (default /tmp/disagg): disagg_<mode>.json (bench serve's result) and per-server
# logs; stdout ends with one JSON line per mode and a summary table.
# Plumbing check on a CPU (tiny model, a few requests, about 2 minutes):
#   PATH=<venv>/bin:$PATH DEVICE=cpu MODEL_CONFIG=minivllm/bench/configs/tiny-llama/config.json NUM_GPUS=2 \
#     NUM_REQUESTS=4 RATE=4 INPUT_LEN="20 60" OUTPUT_LEN="4 12" VOCAB_SIZE=1000 scripts/gpu_disagg.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/vllm-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
NUM_GPUS=${NUM_GPUS:-1}
GA=${GPU_A:-0}; GB=${GPU_B:-1}  # the machine's GPU indices to use (scripts/gpu_multi.sh runs modes side by side)
NUM_REQUESTS=${NUM_REQUESTS:-1000}
RATE=${RATE:-16}
DEVICE=${DEVICE:-cuda}
INPUT_LEN=${INPUT_LEN:-"100 1024"}
OUTPUT_LEN=${OUTPUT_LEN:-"100 1024"}
VOCAB_SIZE=${VOCAB_SIZE:-10000}  # prompt token ids are drawn below this (W3: 10,000)
P_UTIL=${P_UTIL:-0.42}
D_UTIL=${D_UTIL:-0.88}
# pd_shared: explicit KV budgets. Profiled ones failed on an H100 (2026-11-26): the decode instance
# counted the prefill instance's 50 GiB (more than its 0.42 share) as used and planned a negative
# KV cache. The cause, found in lease 8 (2026-11-27, where even explicit budgets ran out of
# memory): the LM head's warm-up cached every row count's logits until the GPU was full (fixed
# in ModelRunner.warm_up_kernels)
# (the CPU plumbing check: host memory, where 16 GiB would not fit beside anything else)
if [ "$DEVICE" = cpu ]; then P_KV=${P_KV:-$((256 << 20))}; D_KV=${D_KV:-$((256 << 20))}; fi
P_KV=${P_KV:-$((8 << 30))}
D_KV=${D_KV:-$((16 << 30))}
BASE_PORT=${BASE_PORT:-8100}
OUTDIR=${OUT:-/tmp/disagg}; mkdir -p "$OUTDIR"
if [ -z "${MODES:-}" ]; then
  MODES="single pd_shared"; [ "$NUM_GPUS" -ge 2 ] && MODES="$MODES pd_2gpu dp_2gpu"
fi
# our server's own wheels when vLLM was not staged: carry ".serve" in the same call (as gpu_w3.sh)
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null && [ -d .serve ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vllm-site .serve/*.whl
fi
MODEL=$(mktemp -d /tmp/disagg-model-XXXX)
cp "${MODEL_CONFIG:-minivllm/bench/configs/qwen3-8b/config.json}" "$MODEL/config.json"
SERVE_FLAGS="--model $MODEL --load-format dummy --max-model-len 4096 --served-model-name bench \
  --skip-tokenizer-init --uvicorn-log-level warning --no-dashboard --device $DEVICE ${OURS_FLAGS:-}"
[ "$DEVICE" = cpu ] && SERVE_FLAGS="$SERVE_FLAGS --kv-cache-memory-bytes $((256 << 20))"
PIDS=()

wait_up() {  # URL PID LOG
  local t0=$SECONDS
  until curl -sf "$1/health" >/dev/null 2>&1; do
    sleep 1
    if ! kill -0 "$2" 2>/dev/null; then echo "server $1 died"; tail -30 "$3"; return 1; fi
    if [ $((SECONDS - t0)) -gt 300 ]; then echo "server $1 not up in 300 s"; tail -30 "$3"; return 1; fi
  done
}

serve() {  # NAME PORT CUDA_VISIBLE_DEVICES UTIL [ROLE [KV_BYTES]]
  local kv=() log="$OUTDIR/server_$1.log"
  [ -n "${5:-}" ] && kv=(--kv-transfer-config "{\"kv_role\": \"$5\"}")
  [ -n "${6:-}" ] && kv+=(--kv-cache-memory-bytes "$6")
  CUDA_VISIBLE_DEVICES=$3 python3 -m minivllm --log-level INFO serve $SERVE_FLAGS --port "$2" --gpu-memory-utilization "$4" \
    "${kv[@]}" > "$log" 2>&1 &
  PIDS+=($!)
  wait_up "http://127.0.0.1:$2" $! "$log"
}

router() {  # NAME PORT ARGS...
  local name=$1 port=$2; shift 2
  python3 -m minivllm router --port "$port" "$@" > "$OUTDIR/router_$name.log" 2>&1 &
  PIDS+=($!)
  wait_up "http://127.0.0.1:$port" $! "$OUTDIR/router_$name.log"
}

stop_all() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  PIDS=()
  # the next mode's servers plan memory from what is free: wait until no process holds the GPU
  if [ "$DEVICE" != cpu ] && command -v nvidia-smi >/dev/null; then
    local t0=$SECONDS
    while [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && [ $((SECONDS - t0)) -lt 60 ]; do
      sleep 1
    done
  fi
}
trap stop_all EXIT

bench() {  # MODE URL
  python3 -m minivllm.server.bench_serve --base-url "$2" --model bench --num-requests "$NUM_REQUESTS" \
    --request-rate "$RATE" --seed 0 --input-len $INPUT_LEN --output-len $OUTPUT_LEN --vocab-size "$VOCAB_SIZE" \
    --engine-label "$1" \
    --output-json "$OUTDIR/disagg_$1.json" --no-progress > "$OUTDIR/bench_$1.log" 2>&1
  echo "[$1] bench exit $? ($OUTDIR/bench_$1.log)"
}

P=$BASE_PORT
for MODE in $MODES; do
  echo "[$MODE] starting"
  case $MODE in
    single)
      serve single $((P + 1)) "$GA" 0.9 && bench single "http://127.0.0.1:$((P + 1))" ;;
    pd_shared)
      serve pd_shared_prefill $((P + 1)) "$GA" "$P_UTIL" kv_producer "$P_KV" \
        && serve pd_shared_decode $((P + 2)) "$GA" "$D_UTIL" kv_consumer "$D_KV" \
        && router pd_shared "$P" --prefill "http://127.0.0.1:$((P + 1))" --decode "http://127.0.0.1:$((P + 2))" \
        && bench pd_shared "http://127.0.0.1:$P" ;;
    pd_2gpu)
      serve pd_2gpu_prefill $((P + 1)) "$GA" 0.9 kv_producer \
        && serve pd_2gpu_decode $((P + 2)) "$GB,$GA" 0.9 kv_consumer \
        && router pd_2gpu "$P" --prefill "http://127.0.0.1:$((P + 1))" --decode "http://127.0.0.1:$((P + 2))" \
        && bench pd_2gpu "http://127.0.0.1:$P" ;;
    dp_2gpu)
      serve dp_2gpu_0 $((P + 1)) "$GA" 0.9 && serve dp_2gpu_1 $((P + 2)) "$GB" 0.9 \
        && router dp_2gpu "$P" --instance "http://127.0.0.1:$((P + 1))" "http://127.0.0.1:$((P + 2))" \
        && bench dp_2gpu "http://127.0.0.1:$P" ;;
    *) echo "unknown mode $MODE" ;;
  esac
  if [ -f "$OUTDIR/server_${MODE}_decode.log" ]; then  # how the decode instance got its KV
    grep -h -m1 -E "mapped producer|host transport" "$OUTDIR/server_${MODE}_decode.log"
    curl -s "http://127.0.0.1:$((P + 2))/load" | python3 -c "import json, sys; d = json.load(sys.stdin); \
print('[$MODE] decode instance:', {k: d[k] for k in ('kv_pulled_blocks', 'kv_pull_failures')})"
  fi
  stop_all
  P=$((P + 10))
done

python3 - "$OUTDIR" $MODES <<'EOF'
import json, os, sys
out, modes = sys.argv[1], sys.argv[2:]
rows = []
for m in modes:
    path = os.path.join(out, f"disagg_{m}.json")
    if not os.path.exists(path):
        print(json.dumps({"mode": m, "error": "no result"}))
        continue
    r = json.load(open(path))
    r["mode"] = m
    print(json.dumps(r))
    rows.append(r)
print(f"{'mode':<10} {'ok':>6} {'failed':>6} {'p99 ITL ms':>11} {'p99 TTFT ms':>12} {'p99 TPOT ms':>12} {'out tok/s':>10}")
for r in rows:
    f = r["figures"]
    vals = [f["requests_finished"], f["requests_failed"], f["itl_ms"]["p99"], f["ttft_ms"]["p99"],
            f["tpot_ms"]["p99"], f["output_tokens_per_s"]]
    print(f"{r['mode']:<10} " + " ".join(f"{v:>{w}.1f}" if isinstance(v, float) else f"{str(v):>{w}}"
                                         for v, w in zip(vals, (6, 6, 11, 12, 12, 10))))
EOF
