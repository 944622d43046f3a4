#!/usr/bin/env bash
# Set up, then save 468 MiB of Megatron-shaped state at 2 ranks, load it back with
# stock Megatron under another sharding (bit-exact check), and print the save's speed beside
# the target's write ceiling and stock DCP's save, measured in the same run.
# Arguments go to `safe-ckpt demo` (--keep or --out DIR keeps the checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
safe-ckpt demo "$@"
