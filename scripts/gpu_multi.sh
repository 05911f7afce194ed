#!/usr/bin/env bash
# The multi-GPU run (issue 27, W9) on one host with several GPUs, in lanes: each argument is
# STEPS@GPUS, where STEPS is one or more steps joined by '+' (run one after the other) and GPUS
# the lane's CUDA_VISIBLE_DEVICES; the lanes of one call run side by side, each on its own GPUs:
#
#   source scripts/gpu_env.sh && bash scripts/gpu_multi.sh check-8b@0,1,2,3
#   bash scripts/gpu_multi.sh 'ours:W1-8B-tp2+ours:W2-tp2@0,1' 'ours:W1-32B-tp2@2,3'
#
# Steps:
#   ENGINE:JOB          a job of minivllm.bench.compare (ours:W1-8B-tp4, vllm:W1-32B-tp2, ...)
#   check-8b            bench parallel-check: Qwen3-8B shapes (4 layers, random seeded weights),
#                       tp1 vs tp2 vs tp4, bf16 (needs 4 GPUs)
#   check-default       the default model's real weights exported to bf16: tp1 vs tp3 vs pp2
#   ar-bench-2 / -4     minivllm.bench.all_reduce_bench: the symmetric-memory all-reduce's checks
#                       and its time against NCCL, 8 KB to 8 MB, on 2 / 4 GPUs
#   profile-tp2         W1-8B cut to 48 tokens a request at tp=2 (mp): traces of the engine and
#                       both ranks (profile-tp1-mp: one rank in a worker process; profile-tp1: in process)
#   w3-dp1 / w3-dp2     W3 (Qwen3-8B, our server) at 16 and 64 req/s with -dp 1 / -dp 2
#   w3-32b-tpN          W3 at 16 req/s on Qwen3-32B shapes, our server, -tp N (N = 2, 4)
#   vllm-w3-32b-tpN     the same on vLLM's server
#   disagg-1gpu         scripts/gpu_disagg.sh: one instance vs P + D sharing one GPU (W3 at 16 req/s)
#   disagg-2gpu         P and D on two GPUs vs two ordinary instances behind the router
#   w7-trace            W7 for minivllm with GPU kernel time per step, constrained vs not
#   w7 / w8 / w12       the single-GPU comparisons of issues 18, 19, 24 (scripts/gpu_w7.sh,
#                       bench spec --engine minivllm|vllm, scripts/gpu_w12.sh), vLLM staged first
#   invariance          bench invariance on the GPU: 1,000 repeats under random load (issue 22)
#   diagnose-invariance scripts/diagnose_invariance.py (chunked vs one-step prefill, module by module)
#   moe-sweep-decode    scripts/sweep_fused_moe.py at M = 1-16; later steps of the lease use the file
#   dense-gemv          scripts/bench_dense_gemv.py --write: the batch-1 GEMV vs cuBLAS; later steps use the table
#   profile-bi / profile-moe1 / profile-fp8  scripts/kernel_profile.py: kernel times (issues 22 / 21 / 25)
#   ab-engine           scripts/ab_engine.sh run $AB_ROUNDS "$AB_SPECS": packages / switches alternately (W11-awq)
#   ab-w1               the same for W1-8B throughput (AB_BENCH=throughput, --repeats 2): $AB_W1_ROUNDS rounds
#                       (default 1) of the packages $AB_W1_SPECS, records in the lane's ab-w1/ folder;
#                       $AB_W1_ARGS adds bench arguments (e.g. "-tp 2 --distributed-executor-backend mp")
#   profile-awq1-trace  profile-awq1-graphs over 32 tokens, its Chrome trace kept (.trace.json.gz)
#   profile-awq1-ab     profile-awq1-graphs of the packages ab/<REF> for each REF of $AB_REFS (ab_engine.sh prepare)
#   profile-graphs      kernel_profile.py in CUDA graphs with PDL, critical-path times (W10, W11-awq, W1-bi-like)
#   awq-gemv-seq        bench_w4a16_gemv.py --sequence: a token's W4A16 GEMVs in one graph per GEMV table (issue 25)
#   awq-gemv-xpair      the same (default and kept launches), XPAIR on and off (issue 25)
#   awq-gemv-pairs      the same, the scales and zeros read as one word a pair and as two tiles (issue 25)
#   awq-gemv-keep       awq-gemv-tiles, then --write-from on the machine: later steps use the new table (issue 25)
#   persistent-chain    scripts/persistent_gemv/chain.cu built with nvcc and run: a token's 128 W4A16 GEMVs in one
#                       persistent launch, each design against its reference (issue 25, docs/perf.md 2026-11-29)
#   tail-profile        scripts/persistent_gemv/profile_tail.py: the engine's W4 layer tail alone and per stage
#                       (issue 25; TAIL_VARIANTS: several builds, e.g. "- W4LT_NO_WAIT W4LT_NO_MATH"; its A/B in
#                       the engine, where it is on by default: ab-engine with AB_SPECS=".@MINIVLLM_W4_LAYER_TAIL=0 .")
#   profile-awq-tail    scripts/kernel_profile.py: W11-awq's critical-path kernel times with the tail on (issue 25)
#   dense-stream        scripts/bench_dense_gemv.py --stream: the streaming dense GEMV's tiles (issue 21)
#   inv-gemm            scripts/bench_invariant_gemm.py: the invariant GEMM's launches vs cuBLAS, with bit checks (issue 22)
#   inv-gemm-splits     the same for o/down at 1, 2 and 4 K slices (issue 22)
#   inv-attn            scripts/bench_invariant_attention.py: the invariant attention tile's launches on decode rows (issue 22)
#   moe-decode          scripts/bench_moe_decode.py: one-token MoE GEMVs, streaming variant sweep, plain read
#   spec-profile-32     scripts/spec_profile.py --batch 32: W8 batch 32, none vs n-gram (issue 19)
#   w8-32first          bench spec none,ngram with batch 32 timed before batch 1 (issue 19)
#   w8-warm             bench spec none,ngram --warm-each-phase, with the SM clock logged (issue 19)
#   w8-diag             bench spec none,ngram with the prefix cache reset between the batch sizes,
#                       then with no step history (which engine state slows batch 32 after batch 1)
#   w7-timeline         w7-trace plus gzipped Chrome traces of both traced runs (issue 18)
#   w7-ab               W7 minivllm alone, then with MINIVLLM_GRAMMAR_PIPELINE=0 (issue 18)
#   w8-interleave       bench spec none,ngram, both engines in one process, timed runs in turn (issue 19)
#   w7-steps            W7 minivllm alone, every step's record of both throughput runs in w7-steps-*.jsonl (issue 18)
#   fp8-sweep           scripts/fp8_gemm_sweep.py: FP8 GEMM variants on Qwen3-8B's shapes (issue 25)
#   soak                bench soak on the GPU (default model, bf16; SOAK_REQUESTS, default 10,000)
#   w1-phases           scripts/w1_step_phases.py: W1-8B's engine steps by host phase and running batch, for each
#                       TP:BACKEND:AHEAD[:REF] of $W1_PHASES (issue 27; e.g. "1:uni:- 1:mp:- 1:mp:1:<commit>")
#   gpu-tests           the single-GPU test files that last failed or never ran (one GPU)
# Each lane gets its own port range (servers) and its own output folder under /tmp/multi, which
# persists while the machine stays warm. What comes back ($OUT, at most 8 files): results.jsonl
# (every record of every call so far on this machine), summary.txt, logs.tgz (all logs).
# NUM_REQUESTS shortens the W3 steps (default 1000, BENCHMARKS.md's). SMOKE=1 runs the compare
# steps in their CPU smoke form (plumbing check: SMOKE=1 OUT=/tmp/x bash scripts/gpu_multi.sh 'ours:W1-8B-tp2+vllm:W1-8B-tp2@').
#
# Lease 63 (2 H200s, 2026-11-28, 70c240c): W1-8B tp=1 9,550, tp=2 7,546 against vLLM's tp=2 14,004:
# the mp step loop is still host-bound (docs/perf.md); vLLM's tp=2 start-up took 307 s. The driver's
# reply thread (84c454d) cost 7 % at tp=1 mp (lease 65) and is now opt-in; next, on and off at tp=2
# (the prediction in perf.md: +15 to +30 %): AB_W1_SPECS=". .@MINIVLLM_DRIVER_REPLY_THREAD=1"
# AB_W1_ROUNDS=2 AB_W1_ARGS="-tp 2 --distributed-executor-backend mp", step ab-w1@0,1.
# Lease 84 (2 H200s, 2026-11-29 evening): two steps in flight with the mp executor gave +5 % at tp=2
# (8,832 -> 9,253 output tok/s, within the spread; vLLM 14,057 in the same call); the cut trace
# (profile-tp2) showed a batch-256 step GPU-bound at 9.7 ms, ~1.6 ms of it rank 0 waiting in an
# all-reduce for rank 1's ~24 ms host stalls (the ranks' heap is frozen since, lease 86). Next on an
# x2 machine, one call (~4 minutes; `bash scripts/ab_engine.sh prepare 70f8d46` here first, 70f8d46 being
# the package before the frozen heap): W1-8B step by step, which batch bands lose at tp=2 (host or
# device), and the frozen heap's A/B at tp=2 (predicted +10-20 %):
#   W1_PHASES="2:mp:- 2:mp:-:70f8d46 2:mp:1 1:uni:- 2:mp:- 2:mp:-:70f8d46" bash scripts/gpu_queue.sh start 'w1-phases@0,1'
# A whole W1 run at tp=2 took 13-15 s against ~7-8 s that the batch-256 trace (8.1 ms a step
# without stalls, against 16 ms at tp=1) and lease 85's tp=1 bands would give: not explained yet.
# What issue 27 still needs (after leases 58-59 on 4 H200s, 2026-11-28; `bash scripts/device_wheels.sh`
# here first; on a 4-GPU machine carry .whl alone and start the ours lanes, then each of .vllm/p1..p5,
# deps, x back to back while they run (~15 s a carry on that link), then .gpu/g1 and .gpu/g2):
#   re-measure W1-8B tp=1/2/4 after de503e1 (columns message, block-table rows): the step loop was
#     host-bound (~10.9 ms of host work a step at batch 256 against 8 ms of GPU at tp=2); run the
#     ours lanes ALONE (side-by-side lanes moved our figures 20 %), e.g.
#     'ours:W1-8B-tp2@0,1' then 'ours:W1-8B-tp4@0,1,2,3', with 'vllm:W1-8B-tp2@0,1' 'vllm:W1-8B@2,3' after
#   'ours:W1-32B-tp2+vllm:W1-32B-tp2@0,1' 'ours:W1-32B-pp2+vllm:W1-32B-pp2@2,3'
#   'ours:W1-32B-tp4@0,1,2,3' 'vllm:W1-32B-tp4@0,1,2,3' 'ours:W1-32B-tp2pp2+vllm:W1-32B-tp2pp2@0,1,2,3'
#   'w3-dp2@0,1' 'w3-dp1@2' 'w3-32b-tp2@...' 'vllm-w3-32b-tp2@...'
#   'ours:W10-tp2-ep+vllm:W10-tp2-ep@0,1' 'ours:W10-decode-tp2-ep+vllm:W10-decode-tp2-ep@2,3'
#   'disagg-1gpu@0' 'disagg-2gpu@1,2' 'check-default@0,1,2' 'soak-bg@3'
# Measured already (docs/perf.md, "The multi-GPU run on 4 H200s"): W1-8B tp=1/2/4 and W2 tp=2 on both
# engines, ar-bench-2/-4, the W1 and W2 traces.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on shared hosts (KINDS.md); keep it so in every child
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=/tmp/multi
mkdir -p "$ROOT"
OUTDIR=${OUT:-/tmp/multi-out}
mkdir -p "$OUTDIR"
CALL=$(date +%H%M%S)

tail_defines() {  # "A,B" -> "A B"; "-" -> nothing (TAIL_VARIANTS' spelling of the defines of one build)
  [ "$1" = "-" ] || echo "$1" | tr ',' ' '
}

profile_invariant_pair() {  # DIR BATCH PROMPT_LEN: Qwen3-0.6B decode in graphs, batch-invariant mode, then default
  local mode flag
  for mode in bi default; do
    flag=; [ "$mode" = bi ] && flag=--batch-invariant
    python3 scripts/kernel_profile.py --model-config qwen3-0.6b --graphs --batch "$2" --prompt-len "$3" --max-tokens 32 \
      $flag --out "$1/profile-$mode$2-graphs.json"
  done
}

# the W4A16 GEMV tiles (BLOCK_N,BLOCK_K,warps,stages) that awq-gemv-tiles and awq-gemv-keep sweep
AWQ_GEMV_TILES="64,256,4,3 128,256,4,3 128,256,8,3 64,512,4,3 128,512,8,3 128,128,4,3 256,128,8,3 32,256,4,3 32,512,4,3 32,256,2,3 64,256,2,3"

run_step() {  # run_step STEP LANE_DIR PORT
  local step=$1 dir=$2 port=$3
  echo "[$(date +%T)] step $step on GPUs $CUDA_VISIBLE_DEVICES"
  case "$step" in
    ours:*|vllm:*|hf:*)
      python3 -m minivllm.bench.compare --only "$step" --out "$dir" --budget-s 580 ${SMOKE:+--smoke} ;;
    check-8b)
      python3 -m minivllm bench parallel-check --model-config qwen3-8b --num-layers 4 --layouts tp1,tp2,tp4 \
        --dtype bfloat16 --skip-tokenizer-init --num-prompts 16 --prompt-len 128 --max-tokens 64 \
        --max-model-len 1024 --output "$dir/check-8b.json" ;;
    ar-bench-2|ar-bench-4)  # issue 27: the symmetric-memory all-reduce vs NCCL (checks, then us a call by size)
      python3 -m minivllm.bench.all_reduce_bench --world-size ${step#ar-bench-} --output "$dir/$step.json" ;;
    profile-tp2|profile-tp1-mp|profile-tp1)  # issue 27: W1-8B's request set cut to 48 tokens a request
      # (decode at batch 256 after a few prefill steps), torch-profiler traces of the engine and each rank, gzipped
      local flags="-tp 2 --distributed-executor-backend mp"
      [ "$step" = profile-tp1-mp ] && flags="--distributed-executor-backend mp"
      [ "$step" = profile-tp1 ] && flags=""
      python3 -m minivllm bench throughput --workload W1-8B $flags \
        --max-output 48 --max-prompt 256 --profile --profile-dir "$dir/$step" --output "$dir/$step.json" \
        ; gzip -f "$dir/$step"/*.json ;;
    profile-w2-tp2)  # issue 27: W2 at tp=2 (mp), 64 tokens of one run, traces of the engine and both ranks
      python3 -m minivllm bench latency --model-config llama-3.1-8b -tp 2 --distributed-executor-backend mp \
        --max-output 64 --reps 1 --no-bandwidth --profile --profile-dir "$dir/$step" --output "$dir/$step.json" \
        ; gzip -f "$dir/$step"/*.json ;;
    check-default)
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 -m minivllm bench parallel-check --model /tmp/smollm2-bf16 --layouts tp1,tp3,pp2 \
        --dtype bfloat16 --num-prompts 16 --prompt-len 128 --max-tokens 64 --max-model-len 1024 \
        --output "$dir/check-default.json" ;;
    w3-dp1|w3-dp2)
      OUT=$dir PORT=$port LABEL=ours-${step#w3-} OURS_FLAGS="-dp ${step#w3-dp}" bash scripts/gpu_w3.sh ours 16 64 ;;
    w3-32b-tp*)
      OUT=$dir PORT=$port LABEL=ours-32b-tp${step#w3-32b-tp} MODEL_CONFIG=qwen3-32b \
        OURS_FLAGS="-tp ${step#w3-32b-tp}" bash scripts/gpu_w3.sh ours 16 ;;
    vllm-w3-32b-tp*)
      OUT=$dir PORT=$port LABEL=vllm-32b-tp${step#vllm-w3-32b-tp} MODEL_CONFIG=qwen3-32b \
        VLLM_FLAGS="-tp ${step#vllm-w3-32b-tp}" bash scripts/gpu_w3.sh vllm 16 ;;
    disagg-1gpu)  # one instance vs prefill + decode instances sharing the lane's first GPU
      OUT=$dir BASE_PORT=$port GPU_A=${CUDA_VISIBLE_DEVICES%%,*} MODES="single pd_shared" bash scripts/gpu_disagg.sh ;;
    disagg-2gpu)  # prefill and decode on the lane's two GPUs vs two instances behind the router
      g=${CUDA_VISIBLE_DEVICES#*,}
      OUT=$dir BASE_PORT=$port GPU_A=${CUDA_VISIBLE_DEVICES%%,*} GPU_B=${g%%,*} NUM_GPUS=2 MODES="pd_2gpu dp_2gpu" \
        bash scripts/gpu_disagg.sh ;;
    soak-bg)  # the soak in its own session: it outlives this call while the machine stays warm;
              # a later call collects $dir/soak.json (keep its GPU out of the lanes meanwhile)
      setsid nohup python3 -m minivllm bench soak --device cuda --requests ${SOAK_REQUESTS:-10000} \
        --output "$dir/soak.json" > "$dir/soak.log" 2>&1 < /dev/null &
      echo "soak started in the background (pid $!)" ;;
    w7)  # W7 structured output, both engines (scripts/gpu_w7.sh; needs the vLLM staging's xgrammar)
      OUT=$dir bash scripts/gpu_w7.sh --steps-dir "$dir" ;;
    w7-trace)  # W7, minivllm alone, then 256 requests' kernel times constrained vs unconstrained (issue 18)
      OUT=$dir bash scripts/gpu_w7.sh --engine minivllm --trace-requests 256 ;;
    w7-timeline)  # issue 18: w7-trace with the Chrome traces of the traced runs (16 tokens a request), gzipped
      OUT=$dir bash scripts/gpu_w7.sh --engine minivllm --trace-requests 256 --trace-max-tokens 16 --trace-dir "$dir" ;;
    w7-steps)  # issue 18: W7 minivllm alone with every step's record of both throughput runs (w7-steps-*.jsonl)
      OUT=$dir bash scripts/gpu_w7.sh --engine minivllm --steps-dir "$dir" ;;
    w7-ab)  # issue 18: W7 minivllm alone, as the engine runs it, then with the pipelined constrained step off
      # (MINIVLLM_GRAMMAR_PIPELINE=0): what the pipelining and the early scheduling buy, in one lease
      mkdir -p "$dir/w7-default" "$dir/w7-nopipe"
      OUT=$dir/w7-default bash scripts/gpu_w7.sh --engine minivllm
      MINIVLLM_GRAMMAR_PIPELINE=0 OUT=$dir/w7-nopipe bash scripts/gpu_w7.sh --engine minivllm
      cp "$dir/w7-default/w7.txt" "$dir/w7-ab-default.txt"; cp "$dir/w7-nopipe/w7.txt" "$dir/w7-ab-nopipe.txt" ;;
    w8-32first)  # issue 19: W8 none and n-gram with batch 32 measured before batch 1 (does the batch-1 phase slow it?)
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram --batch32-first \
        --output "$dir/w8-32first-minivllm.json" ;;
    w8-diag)  # issue 19: batch 32 after batch 1 ran slower for both engines (lease 8 vs 10): which engine state?
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram --reset-prefix-cache \
        --output "$dir/w8-reset-minivllm.json"
      MINIVLLM_STEP_HISTORY=0 python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram \
        --output "$dir/w8-nohistory-minivllm.json" ;;
    w8-interleave)  # issue 19: bench spec none,ngram with both engines in one process, their timed runs taken in turn
      # (the host's drift cancels; paired same-round ratios), medians of 7
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram --interleave --repeats 7 \
        --output "$dir/w8-interleave-minivllm.json" ;;
    w8-warm)  # issue 19: bench spec none,ngram with an untimed run of each batch size just before its timed runs,
      # and the GPU's SM clock logged every 100 ms (is batch 32 slower after batch 1 because the GPU clocked down?)
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv -lms 100 > "$dir/w8-clocks.csv" &
      local smi=$!
      python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram --warm-each-phase \
        --output "$dir/w8-warm-minivllm.json"
      kill $smi ;;
    w8)  # W8 speculative decoding on the default model's real weights, minivllm then vLLM
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      [ -f /tmp/smollm2-draft/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-draft --dtype bfloat16 --num-layers 8 >/dev/null
      # Medusa heads trained on the CPU by scripts/train_medusa.py: the repository's test heads
      # (tests/data/medusa-smollm2, 2 MB), or fresher ones carried as .gpu/medusa
      heads=tests/data/medusa-smollm2; [ -f .gpu/medusa/config.json ] && heads=.gpu/medusa
      [ -f $heads/config.json ] && rm -rf /tmp/medusa-heads && cp -r $heads /tmp/medusa-heads
      medusa=; [ -f /tmp/medusa-heads/config.json ] && medusa="--medusa-model /tmp/medusa-heads"
      python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram,suffix,layer_skip,draft_model${medusa:+,medusa} \
        --draft-model /tmp/smollm2-draft $medusa --output "$dir/w8-minivllm.json"
      PYTHONPATH=/tmp/vllm-site:${PYTHONPATH:-} python3 -m minivllm bench spec --engine vllm --model /tmp/smollm2-bf16 \
        --methods none,ngram,draft_model --draft-model /tmp/smollm2-draft --output "$dir/w8-vllm.json" ;;
    w8-ngram)  # W8's n-gram row alone, minivllm (after the async back-off above disable_by_batch_size)
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 -m minivllm bench spec --model /tmp/smollm2-bf16 --methods none,ngram --output "$dir/w8-ngram-minivllm.json" ;;
    w8-ngram-vllm)  # the same two rows on vLLM 0.20.0, for a speed-up ratio measured in the same lease
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      PYTHONPATH=/tmp/vllm-site:${PYTHONPATH:-} python3 -m minivllm bench spec --engine vllm --model /tmp/smollm2-bf16 \
        --methods none,ngram --output "$dir/w8-ngram-vllm.json" ;;
    profile-spec)  # issue 19: a batch-1 speculative step's host phases and GPU kernels, host vs device verify
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 scripts/spec_profile.py --model /tmp/smollm2-bf16 --methods none,ngram --out "$dir/spec-profile.json"
      MINIVLLM_SPEC_HOST_VERIFY=0 python3 scripts/spec_profile.py --model /tmp/smollm2-bf16 --methods ngram \
        --out "$dir/spec-profile-device-verify.json" ;;
    spec-profile-32)  # issue 19: W8 at batch 32, no speculation vs n-gram (no draft scheduled): host phases, GPU time
      [ -f /tmp/smollm2-bf16/config.json ] || python3 scripts/export_default_model.py /tmp/smollm2-bf16 --dtype bfloat16 >/dev/null
      python3 scripts/spec_profile.py --model /tmp/smollm2-bf16 --batch 32 --top 20 --out "$dir/spec-profile-32.json" ;;
    w12)  # W12 KV pressure: recompute, swap, offload and vLLM's offloading (scripts/gpu_w12.sh)
      OUT=$dir bash scripts/gpu_w12.sh ;;
    w12-ours)  # W12, minivllm's offload then recompute runs alone (the offload tier's copies, issue 24)
      OUT=$dir W12_RUNS=offload bash scripts/gpu_w12.sh; mv "$dir/w12.txt" "$dir/w12-offload.txt"
      OUT=$dir W12_RUNS=recompute bash scripts/gpu_w12.sh ;;
    w12-vllm)  # W12: minivllm's offload tier beside vLLM without and with its CPU offloading (issue 24)
      OUT=$dir W12_RUNS="${W12_VLLM_RUNS:-offload vllm vllm-offload}" bash scripts/gpu_w12.sh ;;
    awq-gemv-seq)  # issue 25: a token's four GEMVs x 32 layers in one graph, per GEMV table (the sweep ranks them alone)
      python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-seq.json" \
        --sequence "default,kept,docs/perf-data/2026-11-27/single-gpu/lease35-w4a16-gemv-table-not-kept.json" ;;
    awq-gemv-tiles)  # issue 25: a tile sweep of the W4A16 GEMV on the same shapes (a few minutes)
      python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-tiles.json" \
        --tiles "$AWQ_GEMV_TILES" ;;
    awq-gemv-keep)  # issue 25: awq-gemv-tiles, then its best launches kept in this machine's copy of the GEMV
      # table (--write-from): the later steps of the lease run with them; the table comes back in the folder
      python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-tiles.json" \
        --tiles "$AWQ_GEMV_TILES"
      python3 scripts/bench_w4a16_gemv.py --write-from "$dir/awq-gemv-tiles.json"
      cp minivllm/kernels/configs/w4a16_gemv/*.json "$dir/" ;;
    awq-tiled-sweep)  # issue 25: the several-row W4A16 kernel's launches at 128 and 32 rows (W11's prefill,
      # batched decode), kept in this machine's copy of its table for the later steps; the table comes back
      python3 scripts/sweep_w4a16_tiled.py --rows "${AWQ_TILED_ROWS:-128,32}" --budget-s "${AWQ_TILED_BUDGET_S:-120}" \
        --write --out "$dir/awq-tiled-sweep.json"
      cp minivllm/kernels/configs/w4a16_tiled/*.json "$dir/" ;;
    gemv-read-probe)  # issue 25: the W4A16 GEMV's reads alone on its own tiles vs a flat read vs the GEMV
      python3 scripts/probe_gemv_read.py --out "$dir/gemv-read-probe.json" ;;
    tail-profile)  # issue 25: the W4 layer tail alone (32 launches in a graph) and per stage (-DW4LT_PROFILE);
      # TAIL_VARIANTS: builds to time in turn, each a comma-separated list of -D defines ("-": none), e.g.
      # "- W4LT_NO_WAIT W4LT_NO_MATH,W4LT_SLOTS=4" (the builds run in parallel first)
      local variants=${TAIL_VARIANTS:--} v
      for v in $variants; do  # the engine's and the profiling build of each, in parallel
        python3 -c "import sys; from minivllm.kernels import w4_layer_tail as lt; d = tuple(sys.argv[1:]); \
lt.load_library(d); lt.load_library(('W4LT_PROFILE',) + d)" $(tail_defines "$v") &
      done
      wait
      for v in $variants; do
        python3 scripts/persistent_gemv/profile_tail.py --defines $(tail_defines "$v") | tee -a "$dir/tail-profile.jsonl"
      done ;;
    profile-awq-tail)  # issue 25: W11-awq's critical-path kernel times in CUDA graphs with the W4 layer tail on
      # (PROFILE_ENV: switches for this step only, e.g. PROFILE_ENV="MINIVLLM_W4_TAIL_ROPE=0")
      env ${PROFILE_ENV:-} MINIVLLM_W4_LAYER_TAIL=1 python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq \
        --graphs --batch 1 --prompt-len 128 --max-tokens 64 --out "$dir/profile-awq1-tail-graphs.json" ;;
    persistent-chain)  # issue 25: scripts/persistent_gemv/chain.cu built with nvcc and run (a token's 128
      # GEMVs in one persistent launch, v1-v4, each checked against its per-stage reference)
      nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/chain scripts/persistent_gemv/chain.cu \
        && /tmp/chain 32 20 | tee "$dir/persistent-chain.jsonl" ;;
    awq-gemv-xpair)  # issue 25: a token's GEMVs in one graph (kept table and default launches), activation
      # pairs loaded as words (the default) and formed in registers (MINIVLLM_W4A16_GEMV_XPAIR=0)
      python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-seq-xpair.json" --sequence "default,kept"
      MINIVLLM_W4A16_GEMV_XPAIR=0 python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-seq-formed.json" \
        --sequence "default,kept" ;;
    awq-gemv-pairs)  # issue 25: a token's GEMVs in one graph (kept table and default launches), each scale and
      # zero read as one word from the interleaved layout (the default) and as two tiles (MINIVLLM_W4A16_GEMV_SZ_PAIRS=0)
      python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-seq-pairs.json" --sequence "default,kept"
      MINIVLLM_W4A16_GEMV_SZ_PAIRS=0 python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-seq-tiles.json" \
        --sequence "default,kept" ;;
    awq-gemv)  # issue 25: the W4A16 GEMV alone on Llama-3.1-8B's batch-1 shapes (scripts/bench_w4a16_gemv.py),
      # W11-awq's fp16 activations (AWQ_GEMV_BF16=1: bf16 too); variants: split-K, plain and packed half2 paths
      [ -n "${AWQ_GEMV_BF16:-}" ] && python3 scripts/bench_w4a16_gemv.py --out "$dir/awq-gemv.json"
      python3 scripts/bench_w4a16_gemv.py --fp16 --out "$dir/awq-gemv-fp16.json" ;;
    invariance)  # issue 22: 1,000 repeats of one prompt under random load, batch-invariant mode, bf16
      python3 -m minivllm bench invariance --device cuda --dtype bfloat16 --repeats ${REPEATS:-1000} --batch-invariant \
        --output "$dir/invariance.json" ;;
    diagnose-invariance)  # issue 22: the first module whose rows differ, chunked vs one-step prefill
      python3 scripts/diagnose_invariance.py > "$dir/diagnose-invariance.txt" 2>&1; tail -30 "$dir/diagnose-invariance.txt" ;;
    moe-sweep-decode)  # issue 21: tile sweep of the fused MoE at decode sizes (Qwen3-30B-A3B), kept for later steps
      python3 scripts/sweep_fused_moe.py --tokens 1,2,4,8,16 --budget-s 300
      python3 scripts/sweep_fused_moe.py --decode-gemv   # the one-token GEMV path's tiles (M = 1's "gemv")
      cp minivllm/kernels/configs/fused_moe/*.json "$dir"/ ;;
    dense-gemv)  # issue 21: the batch-1 dense GEMV's tile sweep against cuBLAS; the table is kept for later steps
      python3 scripts/bench_dense_gemv.py --write --models ${GEMV_MODELS:-qwen3-30b-a3b,llama-3.1-8b} --out "$dir/dense-gemv.json"
      for f in minivllm/kernels/configs/dense_gemv/*.json; do cp "$f" "$dir/dense-gemv-table-$(basename "$f")"; done ;;
    moe-gemv-sweep)  # issue 21: only the one-token MoE GEMV tiles (M = 1's "gemv" entry), kept for later steps
      python3 scripts/sweep_fused_moe.py --decode-gemv
      cp minivllm/kernels/configs/fused_moe/*.json "$dir"/ ;;
    dense-stream)  # issue 21: the streaming dense GEMV's tiles vs the table's GEMV vs cuBLAS (W10 and W2 shapes)
      python3 scripts/bench_dense_gemv.py --stream --models qwen3-30b-a3b,llama-3.1-8b --out "$dir/dense-stream.json" ;;
    profile-bi256)  # issue 22: W1-like batch 256 in graphs, invariant vs default, with idle time by neighbouring kernels
      profile_invariant_pair "$dir" 256 256 ;;
    inv-gemm)  # issue 22: the invariant GEMM's launches (tiles, warps, stages) vs cuBLAS on W1's shapes, same bits or not
      python3 scripts/bench_invariant_gemm.py --out "$dir/inv-gemm.json" ;;
    inv-gemm-splits)  # issue 22: the same for o/down at K slice counts 1, 2 and 4 (the table keeps the best count)
      python3 scripts/bench_invariant_gemm.py --splits 1,2,4 --shapes o,down --out "$dir/inv-gemm-splits.json" ;;
    inv-attn)  # issue 22: batch-invariant mode's attention launches (BLOCK_N, warps, stages) on W1-like decode rows
      python3 scripts/bench_invariant_attention.py --out "$dir/inv-attn.json" ;;
    moe-decode)  # issue 21: the one-token MoE GEMVs vs the streaming variant (tile sweep) vs a plain read
      python3 scripts/bench_moe_decode.py --out "$dir/moe-decode.json" ;;
    profile-graphs)  # issues 21/25/22: critical-path kernel times in CUDA graphs with PDL (W10, W11-awq, W1-bi-like)
      python3 scripts/kernel_profile.py --model-config qwen3-30b-a3b --graphs --batch 1 --prompt-len 128 --max-tokens 64 \
        --out "$dir/profile-moe1-graphs.json"
      MINIVLLM_MOE_DECODE_STREAM=0 MINIVLLM_DENSE_GEMV_STREAM=0 python3 scripts/kernel_profile.py --model-config \
        qwen3-30b-a3b --graphs --batch 1 --prompt-len 128 --max-tokens 64 --out "$dir/profile-moe1-graphs-nostream.json"
      python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq --graphs --batch 1 --prompt-len 128 \
        --max-tokens 64 --out "$dir/profile-awq1-graphs.json"
      profile_invariant_pair "$dir" 16 1500
      profile_invariant_pair "$dir" 256 256 ;;
    profile-bi)  # issue 22: kernel times of W1-like decode at batch 256, invariant mode vs default
      python3 scripts/kernel_profile.py --model-config qwen3-0.6b --batch 256 --batch-invariant --out "$dir/profile-bi.json"
      python3 scripts/kernel_profile.py --model-config qwen3-0.6b --batch 256 --out "$dir/profile-default.json" ;;
    profile-fp8)  # issue 25: kernel times of W11-fp8-like decode (Qwen3-8B, FP8 weights + KV) at batch 256, fp8 vs bf16
      python3 scripts/kernel_profile.py --model-config qwen3-8b --fp8 --graphs --batch 256 --max-tokens 16 \
        --out "$dir/profile-fp8.json"
      python3 scripts/kernel_profile.py --model-config qwen3-8b --graphs --batch 256 --max-tokens 16 \
        --out "$dir/profile-bf16-8b.json" ;;
    profile-awq1-graphs)  # issue 25: profile-awq1's CUDA-graph half alone (critical-path kernel times)
      python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq --graphs --batch 1 --prompt-len 128 \
        --max-tokens 64 --out "$dir/profile-awq1-graphs.json" ;;
    profile-awq1-ab)  # issue 25: profile-awq1-graphs for each package of $AB_REFS (ab/<REF>, scripts/ab_engine.sh
      # prepare), each run from its own folder (from the root, the root's package is imported)
      local ref
      for ref in ${AB_REFS:-}; do
        (cd "ab/$ref" && PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 ../../scripts/kernel_profile.py --model-config \
          llama-3.1-8b --awq --graphs --batch 1 --prompt-len 128 --max-tokens 64 --out "$dir/profile-awq1-graphs-$ref.json")
      done ;;
    ab-engine)  # issue 25: scripts/ab_engine.sh run $AB_ROUNDS "$AB_SPECS" (W11-awq by default), records in the lane
      OUT=$dir bash scripts/ab_engine.sh run "${AB_ROUNDS:-2}" "${AB_SPECS:-.}" | tee "$dir/ab-engine.txt" ;;
    ab-w1)  # the host work of a W1-8B step (after de503e1): packages at other commits, in process, alternately
      mkdir -p "$dir/ab-w1"
      OUT=$dir/ab-w1 AB_BENCH=throughput bash scripts/ab_engine.sh run "${AB_W1_ROUNDS:-1}" "${AB_W1_SPECS:-.}" \
        --workload W1-8B --repeats 2 ${AB_W1_ARGS:-} | tee "$dir/ab-w1.txt" ;;
    profile-awq1-trace)  # issue 25: profile-awq1-graphs over 32 tokens with its Chrome trace kept (host and device
      # events: is the host ahead of the device at each step's start?)
      python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq --graphs --batch 1 --prompt-len 128 \
        --max-tokens 32 --keep-trace --out "$dir/profile-awq1-trace.json" ;;
    profile-awq1)  # issue 25: kernel times of W11-awq's batch-1 decode (Llama-3.1-8B AWQ), eager and in graphs
      python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq --batch 1 --prompt-len 128 --max-tokens 64 \
        --out "$dir/profile-awq1.json"
      python3 scripts/kernel_profile.py --model-config llama-3.1-8b --awq --graphs --batch 1 --prompt-len 128 \
        --max-tokens 64 --out "$dir/profile-awq1-graphs.json" ;;
    profile-moe1)  # issue 21: kernel times of batch-1 decode on Qwen3-30B-A3B shapes, one-token GEMV path on and off
      python3 scripts/kernel_profile.py --model-config qwen3-30b-a3b --batch 1 --prompt-len 128 --max-tokens 64 \
        --out "$dir/profile-moe1.json"
      MINIVLLM_MOE_DECODE_GEMV=0 python3 scripts/kernel_profile.py --model-config qwen3-30b-a3b --batch 1 \
        --prompt-len 128 --max-tokens 64 --out "$dir/profile-moe1-grouped.json" ;;
    decode-variants)  # issue 25: decode attention, bf16 and FP8 caches, FP8 widened to fp16 or to the query's dtype
      python3 scripts/bench_decode_variants.py --out "$dir/decode-variants.json" ;;
    fp8-sweep)  # issue 25: torch._scaled_mm's FP8 variants vs bf16 on Qwen3-8B's linear shapes
      python3 scripts/fp8_gemm_sweep.py --out "$dir/fp8-sweep.json" ;;
    soak)
      python3 -m minivllm bench soak --device cuda --requests ${SOAK_REQUESTS:-10000} --output "$dir/soak.json" ;;
    w1-phases)  # issue 27: W1-8B's engine steps phase by phase (scripts/w1_step_phases.py), for each
      # TP:BACKEND:AHEAD[:REF] of $W1_PHASES (AHEAD "-": MINIVLLM_STEPS_AHEAD unset; REF: the package
      # ab/REF of scripts/ab_engine.sh prepare, else the tree's), one record a step in the lane folder
      local spec tp backend ahead ref pkg n=0
      for spec in ${W1_PHASES:-1:uni:- 2:mp:- 2:mp:1}; do
        n=$((n + 1))
        IFS=: read -r tp backend ahead ref <<< "$spec"
        if [ "$ahead" = - ]; then unset MINIVLLM_STEPS_AHEAD; else export MINIVLLM_STEPS_AHEAD=$ahead; fi
        # (run from the package's folder: a worker process started with `python -m` imports the
        # package of its working directory first, whatever PYTHONPATH says)
        pkg=$(pwd); [ -n "$ref" ] && pkg=$(pwd)/ab/$ref
        (cd "$pkg" && PYTHONPATH=$pkg:$PYTHONPATH python3 "$OLDPWD/scripts/w1_step_phases.py" --out "$dir/w1-phases" \
          --tp "$tp" --backend "$backend" --label "$n-tp$tp-$backend-ahead$ahead-${ref:-tree}") | tee -a "$dir/w1-phases.jsonl"
      done
      unset MINIVLLM_STEPS_AHEAD ;;
    gpu-tests)
      # (the step's rc is pytest's: non-zero if any file failed; leases 8 and 9 read rc=0 over failures)
      local failed=0
      # xgrammar for the structured-output tests (lease 11: test_structured_gpu.py skipped without it)
      bash scripts/xgrammar_stage.sh >/dev/null 2>&1 && export PYTHONPATH=${XGR_SITE:-/tmp/xgr-site}:${PYTHONPATH:-}
      for f in ${GPU_TESTS:-tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_kv_tiers_gpu.py tests/gpu/test_parallel_gpu.py}; do
        timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest -q --maxfail=${GPU_TESTS_MAXFAIL:-1} "$f" -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tail -15
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
      done
      return $failed ;;
    *) echo "gpu_multi: unknown step $step"; return 2 ;;
  esac
}

run_lane() {  # run_lane INDEX STEPS GPUS
  local i=$1 steps=$2 gpus=$3 dir="$ROOT/$CALL-lane$1" port=$((8100 + 20 * $1))
  mkdir -p "$dir"
  export CUDA_VISIBLE_DEVICES=$gpus
  local list
  IFS='+' read -r -a list <<< "$steps"
  for step in "${list[@]}"; do
    run_step "$step" "$dir" "$port" >> "$dir/lane.log" 2>&1
    local rc=$?  # (before the $(date) below, which would reset $?: every step read rc=0 until 2026-11-27)
    echo "[$(date +%T)] lane $i: $step rc=$rc" | tee -a "$dir/lane.log"
    port=$((port + 5))
  done
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
[ -f "$ROOT/topo.txt" ] || nvidia-smi topo -m > "$ROOT/topo.txt" 2>&1
i=0
for lane in "$@"; do
  i=$((i + 1))
  run_lane "$i" "${lane%@*}" "${lane##*@}" &
done
wait

# collect: every record of every call so far (compare.py's results.jsonl; the JSON files of the
# other steps wrapped as records), the logs, a summary
cat "$ROOT"/*-lane*/results.jsonl 2>/dev/null > "$OUTDIR/results.jsonl"
python3 - "$ROOT" >> "$OUTDIR/results.jsonl" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-lane*", "*.json"))):
    try:
        data = json.load(open(f))
    except (OSError, ValueError):
        continue
    print(json.dumps({"job": os.path.basename(f)[:-5], "lane": os.path.basename(os.path.dirname(f)), "result": data}))
EOF
(cd "$ROOT" && tar czf "$OUTDIR/logs.tgz" --exclude='*.jsonl' . 2>/dev/null)
python3 -m minivllm.bench.compare --collect "$OUTDIR/results.jsonl" > "$OUTDIR/summary.txt" 2>&1 || true
for f in "$ROOT"/$CALL-lane*/lane.log; do echo "== $f"; grep -E "rc=|figures|server up|error|Error" "$f" | tail -8; done
for f in "$ROOT"/$CALL-lane*/*.json; do [ -f "$f" ] && echo "== $f" && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('figures', d))[:1500])" "$f"; done
tail -40 "$OUTDIR/summary.txt"
