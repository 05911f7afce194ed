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
# What the single-GPU issues still need (after lease 48, 2026-11-28; the lent machine is an H200:
# kind nvidia-h200; a session's 30 minutes count in full, the start ~40 s; staging all of vLLM takes
# ~8 minutes of held time on this link (7 carrying calls of ~60 s each, then the install): plan the
# vLLM rows of a session into one lease; name only the test files and GPU_TESTS_K that need a run).
#   1. Issue 25, W11-awq at 43.3 % of the H200's int4 roofline (2.598-2.606 ms a token, lease 54,
#      with the scale-zero pairs; 2.73-2.74 before; 1.45x vLLM's Marlin at 2.747 in lease 47; target
#      75 % = 1.53 ms). Lease 47's profile: GEMVs 1.89 ms, LM head 0.25, decode attention 0.20,
#      norms 0.15. Removed: a grid-barrier GEMV chain (lease 46), a stream-K GEMV (48), SZ_L1 (50).
#      Leases 51-54: the GEMV's timing in the engine can move where the kernel timed alone does not
#      (the probe and --sequence missed a 0.39 ms load-order effect and ranked the pairs the wrong
#      way): A/B GEMV changes with ours:W11-awq pairs, or with packages at several commits through
#      scripts/ab_engine.sh (prepare here, run there; ~40 s a run).
#      Next lead, the order effect's cause: the kernel profile in graphs with PDL for the scales-first
#      commit and the current one, each run from its own package folder (prepare ab/4fb363e here with
#      ab_engine.sh, then there: `(cd ab/4fb363e && PYTHONPATH=$PWD:$PYTHONPATH python3 $root/scripts/
#      kernel_profile.py --model-config llama-3.1-8b --awq --graphs --batch 1 --prompt-len 128
#      --max-tokens 64 --out $OUT/p-szfirst.json)` and the same from the root): which kernels lose
#      the 3 us a GEMV, the GEMV or its predecessor.
#      GPU tests not yet run on the final code: tests/gpu/test_quant_kernels.py -k "sz_pairs or
#      quantized_default_model" (the model test needs .gpu/g1 and .gpu/g2: with the tree at ~12.5 MB,
#      .gpu/g1 and .whl no longer fit one call; carry .whl, .gpu/g1, .gpu/g2 in three calls).
#   2. FP8 W1-8B on the H200: 1.01x vLLM by the first run, 0.99x by the best of two (lease 47).
#   3. The fused MoE, dense GEMV and invariant GEMM run on the H100's tables there
#      (tuned_tables.SIBLINGS): a sweep each if they matter.
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
