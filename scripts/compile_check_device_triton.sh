#!/usr/bin/env bash
# The PTX/SASS compile tests against the GPU machine's Triton (3.6 there; this checkout's venv
# has a newer one), before a device lease: lease 40 (2026-11-28) lost its W11 runs to a helper
# that compiled under Triton 3.9 and not under 3.6. Unpacks the device's Triton wheel (for this
# machine's Python) into a cache folder once, then runs the compile tests with it first on
# PYTHONPATH:
#   bash scripts/compile_check_device_triton.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${DEVICE_TRITON:-3.6.0}
SITE=${TRITON_SITE:-/tmp/triton-$VERSION-site}
if [ ! -f "$SITE/triton/__init__.py" ]; then
  tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps "triton==$VERSION" -d "$tmp"
  mkdir -p "$SITE"
  $PY -m zipfile -e "$tmp"/triton-*.whl "$SITE"
  chmod +x "$SITE"/triton/backends/nvidia/bin/*  # (zipfile drops the tools' exec bits)
  rm -rf "$tmp"
fi
PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} $PY -c "import triton; print('triton', triton.__version__)"
PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} $PY -m pytest -q -p no:cacheprovider \
  tests/unit/test_pdl_compile.py tests/unit/test_w4a16_half2_compile.py "$@"
