#!/usr/bin/env bash
# The chaos soak (not part of CI's default run): 200 saves through the Megatron adapter at 2 gloo
# ranks with retention on, while seeded random faults hit (SIGKILL, ENOSPC, EIO, gc mid-save, a
# second process saving the same iteration, an interrupt or EIO at each step of the publish, re-saves
# of the tracked iteration), then the same against a local S3 server (with an unconfirmed last
# commit write). Prints what each attempted, injected, verified and lost.
#   env: SOAK_STEPS (200), SOAK_RANKS (2-4), SOAK_SEED
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -s --soak tests/soak/test_chaos_soak.py "$@"
