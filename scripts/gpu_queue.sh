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
# What the single-GPU issues still need (after lease 57, 2026-11-28; the lent machine is an H200:
# kind nvidia-h200; a session's 30 minutes count in full, the start ~40 s; staging all of vLLM took
# ~8 minutes of held time on the link of lease 47 (7 carrying calls of ~60 s each, then the install),
# ~1.5 minutes in leases 61-63 (~5 s a carry, install 28-39 s): plan the
# vLLM rows of a session into one lease; name only the test files and GPU_TESTS_K that need a run).
#   0. Issue 25 after leases 68-73 (2026-11-29 morning): MINIVLLM_W4_LAYER_TAIL=1 (kernels/w4_layer_tail.py,
#      one persistent launch a layer for o_proj .. down_proj and the next layer's qkv) takes W11-awq to
#      1.90 ms a token (59.6 % of the roofline; 2.46 without). Step tail-profile times it alone; in the
#      engine: ab-engine with MINIVLLM_W4_LAYER_TAIL=1 exported and AB_SPECS=".@MINIVLLM_W4_LAYER_TAIL=0 ."
#      (the kernel is built with the nvcc on PATH there). Leases 74-79 (2026-11-29 late morning):
#      the rotary + K/V store in stage 3 (MINIVLLM_W4_TAIL_ROPE, neutral, kept); fewer tail blocks,
#      the ring waiting for stage 0's input, an L2 prefetch, decode chunk sizes, and attention as the
#      tail's first stage (cb80472, +14 %) were all slower and are gone. The common cause: dependent
#      loads cost ~2-3 us a round trip while the ring streams. Kernel variants A/B in the engine with
#      MINIVLLM_W4_TAIL_DEFINES; tail-profile takes TAIL_VARIANTS (W4LT_NO_WAIT, W4LT_NO_MATH); step
#      profile-awq-tail gives the engine's critical path with the tail on. The same-lease vLLM
#      W11-awq row: lease 81 (vLLM 3.959 ms). The auto default ran in lease 80 (tests 12
#      passed; 1.915 vs 2.461 ms with MINIVLLM_W4_LAYER_TAIL=0). Leases 80-83 (2026-11-29 afternoon)
#      measured slower and removed: resident one-warp attention programs (815153b), down fed by
#      chunks from gate_up (87f9c8b, fa2f530), spinning ring waits (943db19). ab-engine specs take
#      several switches (REF@A=1@B=2); profile-awq-tail takes PROFILE_ENV.
#   1. Issue 25, W11-awq at 45.4 % of the H200's int4 roofline (2.464 ms a token, lease 57; 2.598 in
#      lease 56 before the greedy argmax kernel, SKIP_EMPTY and the one input copy; 1.45x vLLM's
#      Marlin at 2.747 in lease 47; target 75 % = 1.49 ms). Lease 55's profile (d66dc23): GEMVs
#      1.75 ms, LM head 0.24, decode attention 0.20 (less ~0.08 since), norms 0.13, rotary 0.06.
#      Removed: a grid-barrier GEMV chain (lease 46), a stream-K GEMV (48), SZ_L1 (50).
#      Rank GEMV changes by the engine's own A/B (step ab-engine: AB_SPECS=". .@VAR=0" alternately,
#      or packages at other commits prepared with scripts/ab_engine.sh); the probe and --sequence
#      missed a 0.39 ms load-order effect, which lease 55's profiles put inside the GEMV itself
#      (2,090 vs 1,747 us a token on the critical path; the kernels around it unchanged). But with
#      the pairs on, both orders compile to identical SASS under Triton 3.6 (sm_90, the engine's
#      specializations): run an A/A first (the same commit from ab/<REF> and from the root) before
#      trusting a package-against-package A/B; switch A/Bs within one package are not affected.
#      Left: the 6 DtoD copies into the graph's buffers before each step (~13 us), the attention's
#      latency chain, 65 norm launches; 75 % needs a persistent decode layer (nvcc is on the device).
#      Lease 64's prototype (scripts/persistent_gemv/chain.cu: build with nvcc there, run ./chain 32 20):
#      a token's 128 GEMVs in one launch 1.42 ms against 1.92 as separate launches in the same call;
#      1.03 ms with no stage waits; the ring of bulk copies alone 0.84 ms. Chunk-level dataflow with
#      tiles dealt in turn (v4) was 3.39 ms; next: overlap only down's and o's first k chunk.
#      Passed on the final code: test_greedy_argmax.py 20, test_triton_kernels.py -k decode 90,
#      test_pdl.py 4 (lease 58), test_quant_kernels.py -k quantized_default_model 8 (lease 61). The A/A
#      run (lease 61): ab/70c240c 2.472 against the root's 2.474 ms, so the folder moves nothing; lease
#      55's 0.34 ms between two packages is a real difference between those commits, cause still open.
#   2. FP8 W1-8B on the H200: 1.02x vLLM by the first run, 1.00x by the best of two (lease 62).
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
