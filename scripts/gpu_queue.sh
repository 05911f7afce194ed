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
# What the single-GPU issues still need (after lease 12, 2026-11-27; a session's 30 minutes count
# 50-100 % of held time, so order by what closes). W7 and W8 need no vLLM for minivllm alone:
# carry .vllm/x and .vllm/deps (two calls, `bash scripts/vllm_stage.sh`) for xgrammar instead.
#   1. 'gpu-tests+w7-ab+w8-warm+ours:W2+ours:W2-nogemv@0'  with GPU_TEST_TIMEOUT=600
#      GPU_TESTS="tests/gpu/test_triton_kernels.py tests/gpu/test_invariant_gemm.py
#      tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_structured_gpu.py tests/gpu/test_gpu_correctness.py
#      tests/gpu/test_dense_gemv.py"
#      First the code that never ran on a GPU: the 16-row invariant attention tile and the invariant
#      GEMM's K split (bit for bit), the structured GPU tests (xgrammar now staged for them), the
#      engine on the dense GEMV. Then 18: W7 after the early scheduling (predicted 52.7 % -> ~30 %)
#      with the `steady` phase medians and the pipelined / early step counts, against the same run
#      with the pipelining off; 19: batch 32 after batch 1 with an untimed run of each phase
#      first and the SM clock logged; 21: the dense GEMV on Llama-3.1-8B (W2), predicted -0.2 ms a token.
#   2. 'moe-gemv-sweep+w7+w8-ngram+w8-ngram-vllm+ours:W10-decode+vllm:W10-decode@0'  with vLLM staged
#      (18, 19 and 21 against vLLM in the same lease; W10-decode 4.0 ms = 52 % in lease 12, vLLM 4.94 in
#      lease 2; the sweep now tries K tiles up to a whole row)
#   3. 'profile-bi+ours:W1-bi+vllm:W1-bi+profile-fp8+ours:W11-fp8+vllm:W11-fp8@0'  (22: W1-bi predicted
#      11,479 -> ~13,000 tok/s; 25: where the FP8 step goes, 0.96x in lease 9)
#   4. 'awq-gemv+ours:W11-awq+ours:W11-awq-fold+vllm:W11-awq+profile-awq1@0'  (25: the GEMV's zero-folding
#      variant, predicted up to ~1.4x on the GEMVs if their integer ops bound them, W11-awq 180 -> ~210 tok/s;
#      make it the default only if it wins; GPU test: test_quant_kernels.py::test_w4a16_gemv_fold_zeros)
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
