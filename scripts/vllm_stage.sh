#!/usr/bin/env bash
# On the GPU machine, from the repository root: stages the vLLM 0.20.0 pieces that this call
# carried (.vllm/p1 .. p5, .vllm/deps, .vllm/x; see scripts/vllm_carry.md) into $VLLM_STAGE
# (/tmp/vllm-stage), and once all six are there, installs vLLM into $VLLM_SITE (/tmp/vllm-site)
# the way ../shared/peers/vllm-0.20.0/install.sh does: dependency wheels, then the vLLM wheel
# rebuilt from its pieces and checked against its sha256. Idempotent: run it at the start of
# every call; it prints what is staged and what is still missing. Exit status 0 unless an
# install was attempted and failed.
set -u
STAGE=${VLLM_STAGE:-/tmp/vllm-stage}
TARGET=${VLLM_SITE:-/tmp/vllm-site}
PIECES="p1 p2 p3 p4 p5 deps x"
SHA=24d28892e210200f6e1bd13f699c42a74cd2bb7364c11248e2348f677c7f6dfb
WHEEL=/tmp/vllm-0.20.0-cp38-abi3-manylinux_2_35_x86_64.whl
mkdir -p "$STAGE"
for d in $PIECES; do
  if [ -d ".vllm/$d" ] && [ -n "$(ls -A ".vllm/$d" 2>/dev/null)" ] && [ ! -f "$STAGE/$d/.complete" ]; then
    mkdir -p "$STAGE/$d" && cp .vllm/"$d"/* "$STAGE/$d/" && touch "$STAGE/$d/.complete" && echo "vllm_stage: staged $d"
  fi
done
missing=""
for d in $PIECES; do [ -f "$STAGE/$d/.complete" ] || missing="$missing $d"; done
if [ -f "$TARGET/.minivllm-installed" ]; then
  echo "vllm_stage: vLLM already installed in $TARGET"; exit 0
fi
if [ -n "$missing" ]; then
  echo "vllm_stage: still missing:$missing (carry them in the next calls, keep the machine warm)"; exit 0
fi
echo "vllm_stage: all pieces here; installing into $TARGET"
t0=$SECONDS
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TARGET"
$PIP "$STAGE"/deps/*.whl "$STAGE"/x/*.whl || { echo "vllm_stage: dependency install failed"; exit 1; }
cat "$STAGE"/p1/vllm.part_* "$STAGE"/p2/vllm.part_* "$STAGE"/p3/vllm.part_* "$STAGE"/p4/vllm.part_* \
    "$STAGE"/p5/vllm.part_* > "$WHEEL"
echo "$SHA  $WHEEL" | sha256sum -c - || { echo "vllm_stage: wheel checksum mismatch"; exit 1; }
$PIP --upgrade "$WHEEL" || { echo "vllm_stage: vLLM install failed"; exit 1; }
rm -f "$WHEEL"
PYTHONPATH=$TARGET python3 -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__, 'ready')" \
  || { echo "vllm_stage: import check failed"; exit 1; }
touch "$TARGET/.minivllm-installed"
echo "vllm_stage: installed in $((SECONDS - t0)) s"
