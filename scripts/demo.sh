#!/usr/bin/env bash
# Set up, then save 384 MiB of Megatron-shaped state at 2 ranks, load it back with
# stock Megatron under another sharding (bit-exact check), and print the save's speed beside
# the target's write ceiling and stock DCP's save, measured in the same 5 rounds: medians with
# their spread, and the target's filesystem (tmpfs or disk).
# Arguments go to `safe-ckpt demo` (--size-mb, --ranks; --keep or --out DIR keeps the checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
safe-ckpt demo "$@"
