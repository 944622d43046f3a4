#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU machine (see README "GPU machine"):
#   part "tests": machine description, the CPU suite (megatron-core from .whl, e.g. 0.19),
#                 the GPU tests, and a small benchmark with memcpy counts;
#   part "bench": the 8+ GB benchmark (tmpfs and disk) beside stock Megatron, DCP and ceilings.
#   part "gputests": only the GPU tests.
# Usage: bash benchmarks/gpu_suite.sh tests|gputests|bench|all   (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
OUT=${OUT:-/tmp/safe_ckpt_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# Megatron-LM's megatron.training (not on PyPI), for the real-model tests: carried as .mlm/
[ -d .mlm/megatron/training ] && export PYTHONPATH=$PWD/.mlm:$PYTHONPATH
DISK=${DISK:-/tmp/safe_ckpt_bench}
SHM=${SHM:-/dev/shm/safe_ckpt_bench}
PYTEST="python3 -m pytest -q -p no:cacheprovider -W ignore::UserWarning -W ignore::FutureWarning"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" 2>/dev/null
  echo "cores $(getconf _NPROCESSORS_ONLN)"; free -g; df -hT /tmp /dev/shm; uname -r
  lscpu | grep -m1 'Model name'
} > "$OUT/machine.txt" 2>&1

if [ "$PART" = tests ] || [ "$PART" = all ]; then
  $PYTEST -m "not gpu" tests --timeout 600 > "$OUT/cpu_suite_on_gpu_box.log" 2>&1
  tail -3 "$OUT/cpu_suite_on_gpu_box.log"
fi
if [ "$PART" = tests ] || [ "$PART" = gputests ] || [ "$PART" = all ]; then
  $PYTEST -m gpu tests/test_gpu.py -rA --timeout 300 ${GPU_K:+-k "$GPU_K"} > "$OUT/gpu_tests.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -20
fi
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  python3 -m safe_ckpt.bench --gib 1 --reps 2 --targets "$SHM" --cache cold --count-h2d \
    --label "smoke 1 GiB" --out "$OUT/bench_smoke" > "$OUT/bench_smoke.log" 2>&1
  grep '^|' "$OUT/bench_smoke.md"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  python3 -m safe_ckpt.bench --gib ${GIB:-8.6} --reps ${REPS:-3} --peer-reps ${PEER_REPS:-2} \
    --targets "$SHM,$DISK" --cache cold,warm --peer-cache ${PEER_CACHE:-cold} --residences ${RESIDENCES:-gpu} \
    --peers ${PEERS:-all} --label "H200 ${GIB:-8.6} GiB one rank" --out "$OUT/bench_h200" > "$OUT/bench.log" 2>&1
  tail -3 "$OUT/bench.log"; grep '^|' "$OUT/bench_h200.md"
fi
