#!/usr/bin/env bash
# The chaos soak (not part of CI's default run): 200 saves through the Megatron adapter at 2 gloo
# ranks with retention on, while seeded random faults hit (SIGKILL, ENOSPC, EIO, gc mid-save, a
# second process saving the same iteration). Prints what it attempted, injected, verified and lost.
#   env: SOAK_STEPS (200), SOAK_RANKS (2-4), SOAK_SEED
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -s --soak tests/test_chaos_soak.py "$@"
