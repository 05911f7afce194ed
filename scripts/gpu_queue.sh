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
# What the single-GPU issues still need (after lease 18, 2026-11-27; a session's 30 minutes count
# 50-100 % of held time, so order by what closes; issues 18 and 19 are closed). Staging all of
# vLLM takes ~1.5 minutes of held time; name only the test files (and GPU_TESTS_K) that need a run.
#   1. GPU_TESTS=tests/gpu/test_quant_kernels.py GPU_TESTS_K="fused_fp8 or default_model or test_w4a16"
#      'gpu-tests+profile-awq1+awq-gemv-tiles@0'
#      (25: the relaxed fused-quantizer test, never run on a GPU, and the W4A16 tests and the
#      quantized default model with the half2 GEMV as the default; where W11-awq's 3.89 ms a token
#      go now that the packed half2 GEMV is the default (lease 18: 257 tok/s, 1.08x vLLM, 40.8 % of
#      the roofline; target 75 %); half2 tiles for o and qkv, whose split-K GEMVs read 0.86-1.36 TB/s)
#   2. 'ours:W1-bi+vllm:W1-bi+profile-bi@0'  with vLLM staged
#      (22: 0.905x vLLM's invariant mode in lease 16, target 1.2x; where the invariant step goes.
#      Not measured yet: W1's tail, when few requests with long contexts remain, is where the
#      invariant mode should lose most (the default decode kernel splits a context over many
#      programs; the invariant path walks it in one program per kv head, and the 64-row GEMM tile
#      idles at a few rows); profile a batch of ~16 with ~1,500-token contexts as well as 256)
#   3. 'moe-gemv-sweep+ours:W10-decode+vllm:W10-decode+profile-moe1@0'  (21: 3.93 ms, 52.2 % in lease 13,
#      1.27x vLLM; target 60 %) after the next change to the MoE GEMVs.
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
