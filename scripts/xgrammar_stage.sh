#!/usr/bin/env bash
# On the GPU machine: makes xgrammar (and jsonschema) importable for minivllm without touching
# the image's packages. If `import xgrammar, jsonschema` already works, nothing to do. Otherwise
# installs, with pip --no-index --no-deps --target $XGR_SITE (/tmp/xgr-site), the wheels that the
# vLLM staging brought (scripts/vllm_carry.md: /tmp/vllm-stage/x holds xgrammar 0.2.5.post1,
# /tmp/vllm-stage/deps apache-tvm-ffi and jsonschema with its dependencies), or, if .vllm/x and
# .vllm/deps are carried in this call, from there. Use it with PYTHONPATH=$XGR_SITE:<repo>.
set -u
SITE=${XGR_SITE:-/tmp/xgr-site}
STAGE=${VLLM_STAGE:-/tmp/vllm-stage}
# (xgrammar imports pydantic, which the image may lack: gpu_env.sh puts the carried .whl's copy on
# PYTHONPATH, so the checks keep the caller's path after $SITE; lease 11's check without it failed)
if python3 -c "import xgrammar, jsonschema" 2>/dev/null || PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "import xgrammar, jsonschema" 2>/dev/null; then
  echo "xgrammar_stage: xgrammar and jsonschema importable (PYTHONPATH=$SITE if not in the image)"; exit 0
fi
wheels=""
for dir in "$STAGE/x" "$STAGE/deps" .vllm/x .vllm/deps; do
  for pat in "xgrammar-*.whl" "apache_tvm_ffi-*.whl" "jsonschema-*.whl" "jsonschema_specifications-*.whl" \
             "referencing-*.whl" "rpds_py-*.whl" "attrs-*.whl"; do
    for w in $dir/$pat; do [ -f "$w" ] && wheels="$wheels $w"; done
  done
done
if [ -z "$wheels" ]; then
  echo "xgrammar_stage: no xgrammar wheel found (carry .vllm/x and .vllm/deps, see scripts/vllm_carry.md)"; exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $wheels \
  && PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "import xgrammar, jsonschema; print('xgrammar_stage: ready in $SITE')"
