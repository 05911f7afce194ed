# Source this on the GPU machine, from the repository root, at the start of every call of a
# device session: stages what the call carried (vLLM pieces: scripts/vllm_stage.sh; the default
# model's two halves: scripts/gguf_stage.sh) and puts what is staged on PYTHONPATH (the default
# model; vLLM's site, which also gives minivllm gguf, fastapi, uvicorn, xgrammar and jsonschema).
#
#   source scripts/gpu_env.sh && python3 -m pytest -q tests/gpu/test_x.py
export PYTHONUNBUFFERED=1
[ -d .vllm ] && bash scripts/vllm_stage.sh | tail -2
[ -d .gpu ] && bash scripts/gguf_stage.sh
_pp=$(pwd):/tmp/gguf-site
# single wheels carried in .whl (e.g. gguf alone, for the default model without vLLM's site)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && _pp=$_pp:/tmp/site
elif [ -d /tmp/site ]; then _pp=$_pp:/tmp/site; fi
[ -f /tmp/vllm-site/.minivllm-installed ] && _pp=$_pp:/tmp/vllm-site
export PYTHONPATH=$_pp${PYTHONPATH:+:$PYTHONPATH}
unset _pp
