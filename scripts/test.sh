#!/usr/bin/env bash
# Set up, then run the test suite (CPU; GPU tests are skipped where CUDA is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
