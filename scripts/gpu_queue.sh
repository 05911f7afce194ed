#!/usr/bin/env bash
# One queue of scripts/gpu_multi.sh steps per device lease, run in the background so that it is
# not cut at a call's 10-minute limit; later calls keep the machine warm and bring back what is
# done (the machine goes back 30 s after a call ends, so issue them back to back):
#
#   source scripts/gpu_env.sh && bash scripts/gpu_queue.sh start 'gpu-tests+w7+w8@0'
#   source scripts/gpu_env.sh && bash scripts/gpu_queue.sh wait 560     # repeat until "queue done"
#
# `wait S` returns when the queue ends or after S seconds, whichever is first, and leaves in $OUT
# queue.tgz (every lane folder of /tmp/multi so far: records, JSON, logs) and progress.txt.
#
# Carry order on a fresh lease (after `bash scripts/device_wheels.sh` here), back to back: each of
# .vllm/p1 .. p5, .vllm/deps, .vllm/x with `bash scripts/vllm_stage.sh`; then .gpu/g1 + .whl; then
# .gpu/g2 with `source scripts/gpu_env.sh >/dev/null && bash scripts/gpu_queue.sh start ...`
# (source it with a redirect, never through a pipe: a piped `source` runs in a subshell and
# the queue then lacks PYTHONPATH). Start a queue only after the last one is done (`wait` says so):
# two at once share the GPU and spoil both timings.
#
# What the single-GPU issues still need (after lease 30, 2026-11-27; a session's 30 minutes count
# 50-100 % of held time, so order by what closes). Staging all of vLLM takes ~1.5 minutes of held
# time; name only the test files (and GPU_TESTS_K) that need a run.
#   1. Issue 22, W1-bi at 1.15-1.19x vLLM's invariant mode on first runs (1.11-1.14x on second
#      runs; target 1.2x). What is left of the mode's cost, from profile-bi256 (lease 29): the
#      invariant GEMM 46.6 ms against ~36 for cuBLAS (the LM head above 128 rows, 184 vs 150 us at
#      256; the narrow o/down weights), the prefill kernel on decode rows ~4 % slower than the split
#      decode kernel at 256 rows, and 16-row tiles on prompt chunks. Prepared, unmeasured: the
#      GEMM sweep of other K slice counts for o/down (bench_invariant_gemm.py --splits 1,2,4, then
#      --write-from), and the attention row sums on the tensor cores (ROWSUM_MMA: inv-attn's last
#      part says whether 16/32/64-row tiles then give the same bits and what a 64-row tile saves on
#      prompt chunks; if the same, the backend can take prefill_config's BLOCK_M in the mode).
#      So: the steps
#      ('inv-gemm-splits+inv-attn@0') first, then 'ours:W1-bi+vllm:W1-bi+ours:W1-bi+vllm:W1-bi@0' with vLLM staged.
#   2. Issue 25, W11-awq at ~44 % of the int4 roofline (target 75 %): 'profile-graphs@0' for the
#      GEMV's critical-path time with PIPE on (2.73 ms a token before it).
set -u
cd "$(dirname "$0")/.."
Q=/tmp/queue
mkdir -p "$Q"

report() {
  local out=${OUT:-$Q/out}
  mkdir -p "$out"
  {
    echo "queue: $(kill -0 "$(cat "$Q/pid" 2>/dev/null)" 2>/dev/null && echo running || echo done) at $(date +%T)"
    for f in /tmp/multi/*-lane*/lane.log; do [ -f "$f" ] && echo "== $f" && grep -E "step |rc=" "$f" | tail -30; done
    echo "== driver"; tail -5 "$Q/driver.log" 2>/dev/null
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  } > "$out/progress.txt"
  (cd /tmp && tar czf "$out/queue.tgz" multi queue/driver.log 2>/dev/null)
  cat "$out/progress.txt"
}

case "${1:-}" in
  start)
    shift
    OUT=$Q/final setsid nohup bash scripts/gpu_multi.sh "$@" > "$Q/driver.log" 2>&1 < /dev/null &
    echo $! > "$Q/pid"
    echo "queue started (pid $(cat "$Q/pid")): $*" ;;
  wait)
    deadline=$((SECONDS + ${2:-560}))
    while kill -0 "$(cat "$Q/pid" 2>/dev/null)" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    report ;;
  *) echo "usage: gpu_queue.sh start LANE... | wait SECONDS"; exit 2 ;;
esac
