#!/usr/bin/env bash
# Set up, then save ~400 MB of Megatron-shaped state at 2 ranks, load it back with
# stock Megatron under another sharding (bit-exact check) and print the throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
safe-ckpt demo "$@"
