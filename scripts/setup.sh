#!/usr/bin/env bash
# Create .venv (once) with torch, megatron-core and safe_ckpt installed in editable mode.
# Python 3.11 takes torch==2.13.0 and megatron-core 0.16.1 (what CI tests); Python 3.12+ takes
# the newest torch and may use megatron-core 0.17-0.19 (set MCORE_VERSION to pick one).
# torch comes from pip's index; on Linux, PyPI serves its CUDA build (about 3 GB with the NVIDIA
# libraries). TORCH_INDEX=cpu takes the CPU build instead (about 200 MB, enough for everything
# but the GPU tests); TORCH_INDEX=<url> any other index, e.g. https://download.pytorch.org/whl/cu128.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pyver=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if ! python -c 'import torch' 2>/dev/null; then
  if [ "$pyver" = "3.11" ]; then torch_spec="torch==2.13.0"; else torch_spec="torch>=2.6"; fi
  case "${TORCH_INDEX:-}" in
    "") index=() ;;
    cpu) index=(--index-url https://download.pytorch.org/whl/cpu) ;;
    *) index=(--index-url "$TORCH_INDEX") ;;
  esac
  if [ ${#index[@]} -eq 0 ]; then
    echo "setup: installing $torch_spec from pip's index. On Linux, PyPI's torch is the CUDA build:" \
         "about 3 GB to download with its NVIDIA libraries. Without a GPU, stop now (Ctrl-C) and run" \
         "'TORCH_INDEX=cpu bash $0' for the CPU build (about 200 MB, from https://download.pytorch.org/whl/cpu)." >&2
  else
    echo "setup: installing $torch_spec from ${index[1]}" >&2
  fi
  pip install "${index[@]}" "$torch_spec"
fi
MCORE_VERSION=${MCORE_VERSION:-0.16.1}
# compat: the clone's path on sys.path, so Python started beside the clone still imports the package
pip install -q "megatron-core==${MCORE_VERSION}" -e '.[test]' --config-settings editable_mode=compat
