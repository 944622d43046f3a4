#!/usr/bin/env bash
# Create .venv (once) with torch, megatron-core and safe_ckpt installed in editable mode.
# Python 3.11 machines take the local CPU wheel torch==2.13.0 and megatron-core 0.16.1;
# Python 3.12+ may use megatron-core 0.17-0.19 (set MCORE_VERSION to pick one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pyver=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if ! python -c 'import torch' 2>/dev/null; then
  if [ "$pyver" = "3.11" ]; then pip install -q "torch==2.13.0"; else pip install -q "torch>=2.6"; fi
fi
MCORE_VERSION=${MCORE_VERSION:-0.16.1}
pip install -q "megatron-core==${MCORE_VERSION}" -e '.[test]'
