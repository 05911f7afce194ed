#!/usr/bin/env bash
# W12 (KV pressure) on the GPU machine, from the repository root: Qwen3-8B shapes, dummy weights, a
# KV cache of ~1.25 GiB (about 4 of W12's 16 prefixes of 2,064 tokens at 144 KiB a token), then
# minivllm with recompute, swap and CPU offload, and vLLM 0.20.0 without and with its CPU offloading
# (kv_offloading_size) if it was staged (scripts/vllm_carry.md). Each run in its own process; JSON
# in $OUT/w12-*.json, the log on stdout and in $OUT/w12.txt.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-/tmp}"
KV="${W12_KV_BYTES:-1342177280}"
HOST_GIB="${W12_HOST_GIB:-8}"
RUNS=" ${W12_RUNS:-recompute swap offload vllm vllm-offload} "  # a subset: e.g. W12_RUNS="recompute offload"
if [ -d .vllm ]; then bash scripts/vllm_stage.sh || echo "gpu_w12: vLLM staging failed"; fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
run() {  # name, then the command's arguments
    local name="$1"; shift
    case "$RUNS" in *" ${name#minivllm-} "*) ;; *) return 0 ;; esac
    echo "== W12 $name: $*"
    timeout 900 "$@" --workload W12 --kv-cache-memory-bytes "$KV" --output "$OUT_DIR/w12-$name.json" \
        || echo "gpu_w12: $name failed (rc $?)"
}
{
run minivllm-recompute python3 -m minivllm bench throughput --preemption-mode recompute
run minivllm-swap python3 -m minivllm bench throughput --preemption-mode swap --swap-space "$HOST_GIB"
run minivllm-offload python3 -m minivllm bench throughput --kv-offloading-size "$HOST_GIB"
if python3 -c "import vllm" 2>/dev/null; then
    run vllm python3 -m minivllm.bench.peers.vllm_runner throughput
    run vllm-offload python3 -m minivllm.bench.peers.vllm_runner throughput --kv-offloading-size "$HOST_GIB"
else
    echo "gpu_w12: vLLM is not importable: its runs are skipped"
fi
} 2>&1 | tee "$OUT_DIR/w12.txt"
