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
# Before a lease that runs changed Triton kernels: `bash scripts/compile_check_device_triton.sh` here
# (the compile tests under the device's Triton 3.6; lease 40 lost its runs to a 3.9-only construct).
# Carry order on a fresh lease (after `bash scripts/device_wheels.sh` here), back to back: each of
# .vllm/p1 .. p5, .vllm/deps, .vllm/x with `bash scripts/vllm_stage.sh`; then .gpu/g1 + .whl; then
# .gpu/g2 with `source scripts/gpu_env.sh >/dev/null && bash scripts/gpu_queue.sh start ...`
# (source it with a redirect, never through a pipe: a piped `source` runs in a subshell and
# the queue then lacks PYTHONPATH). Start a queue only after the last one is done (`wait` says so):
# two at once share the GPU and spoil both timings.
#
# What the single-GPU issues still need (after lease 42, 2026-11-28; a session's 30 minutes count
# in full; staging all of vLLM takes ~1.5 minutes of held time; name only the test files and
# GPU_TESTS_K that need a run: `test_quant_kernels.py -k w4a16` alone takes ~8 minutes).
#   1. Issue 25, W11-awq at 52-53 % of the int4 roofline (3.03-3.11 ms a token over leases 37-42,
#      1.36x vLLM's Marlin in lease 37; target 75 % = 2.12 ms). Leases 40-42 folded the rotary into
#      the K/V store and the attention merge into the split kernel (W2 -2.2 %, W11-awq within its
#      lease-to-lease spread); SWIGLU in the gate_up GEMV lost (its 16 + 16-column halves read
#      64-byte runs). Left: the GEMVs' ~4-5 us each above their bytes (0.6 ms a token), ~190 other
#      launches. Next: the norms into the o/down GEMVs' split-K fix-up (the last tile program of
#      the launch adds the residual and normalizes the row), gate/up columns interleaved in the
#      stored weight so that SWIGLU reads whole lines, then a persistent layer kernel. Run
#      ours:W11-awq twice per lease: single runs differ by up to 0.06 ms.
#   2. Issue 22 (closed; W1-bi 1.24-1.29x vLLM on first runs, 1.16-1.20x on second runs): to widen the
#      second-run margin, the LM head above 128 rows (184 vs 150 us at 256) and gate_up above 256.
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
