#!/usr/bin/env bash
# Engine-level A/B of minivllm packages at several commits, in one device call (issue 25). Leases
# 51-54 showed that a GEMV change can move W11-awq's token by 0.4 ms while the kernel timed alone
# (scripts/probe_gemv_read.py, bench_w4a16_gemv.py --sequence) shows nothing: rank such changes
# here, the packages run alternately on the same machine.
#
#   here:    bash scripts/ab_engine.sh prepare REF [REF ...]   # ab/<REF>/minivllm from `git archive`
#   device:  source scripts/gpu_env.sh >/dev/null && bash scripts/ab_engine.sh run ROUNDS "REF ..." [bench args]
#            (with run's `carry` naming nothing extra: ab/ is untracked and not ignored, so it travels
#            with the tree, ~3 MB a package; delete it here afterwards: rm -rf ab). AB_DIR names another
#            folder of packages: copy ab/ to /tmp/ab in the lease's first call and run with AB_DIR=/tmp/ab
#            when later calls carry 49 MB vLLM pieces (the tree and a piece must stay under 64 MiB).
#
# REF "." is the working tree's own package. Each run is `python3 -m minivllm bench latency` (W11-awq by
# default; AB_BENCH=throughput runs `bench throughput` instead, e.g. with args --workload W1-8B) started
# from the package's own folder: from the repository root, `-m` imports the root's package whatever
# PYTHONPATH says (lease 52 lost a comparison to that). Records: $OUT/<REF>-<round>.json ("." is named
# "tree"; the records' minivllm_git names the checkout, not the REF); one line a run: REF, round, ms a
# token, TTFT ms (throughput: output tok/s, best of the repeats). An environment switch can ride on a REF as
# REF@VAR=VALUE (e.g. .@MINIVLLM_W4A16_GEMV_SZ_PAIRS=0), several as REF@VAR=VALUE@VAR2=VALUE2.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

prepare() {
  for ref in "$@"; do
    [ "$ref" = "." ] && continue
    rm -rf "ab/$ref" && mkdir -p "ab/$ref"
    git archive "$ref" minivllm | tar -x -C "ab/$ref"
    echo "ab/$ref: $(git log --oneline -1 "$ref")"
  done
}

run_one() {  # REF[@VAR=VALUE[@VAR2=VALUE2 ...]] ROUND BENCH_ARGS...
  local spec=$1 round=$2; shift 2
  local ref=${spec%%@*} env_kv=(X_AB_ENGINE=1) dir
  [ "$spec" != "$ref" ] && IFS=@ read -ra env_kv <<< "${spec#*@}"
  dir=$root; [ "$ref" != "." ] && dir=${AB_DIR:-$root/ab}/$ref
  [ -d "$dir/minivllm" ] || { echo "no package for $ref: run prepare here first" >&2; return 1; }
  local name out_file
  name=$(echo "$spec" | sed 's/^\./tree/' | tr -c 'A-Za-z0-9._=\n-' '_')
  out_file=${OUT:-/tmp}/$name-$round.json
  (cd "$dir" && env PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "${env_kv[@]}" python3 -m minivllm bench "${AB_BENCH:-latency}" "$@" \
     --output "$out_file" > "${out_file%.json}.log" 2>&1)
  python3 -c "import json,sys; f=json.load(open(sys.argv[1]))['figures']; \
print(sys.argv[2], sys.argv[3], *((round(f['ms_per_token'], 4), round(f['ttft_s'] * 1e3, 2)) if 'ms_per_token' in f \
else (round(f['output_tok_per_s'], 1), round(f['best_output_tok_per_s'], 1))))" "$out_file" "$spec" "$round"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run)
    rounds=$2 refs=$3; shift 3
    args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--model-config llama-3.1-8b --quantization awq)
    for round in $(seq 1 "$rounds"); do
      for spec in $refs; do run_one "$spec" "$round" "${args[@]}"; done
    done ;;
  *) sed -n 2,18p "$0"; exit 2 ;;
esac
