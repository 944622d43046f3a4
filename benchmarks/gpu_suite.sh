#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU machine (see README "GPU machine"):
#   part "tests": machine description, the CPU suite (megatron-core from .whl, e.g. 0.19),
#                 the GPU tests, and a small benchmark with memcpy counts;
#   part "bench": the 8+ GB benchmark (tmpfs and disk) beside stock Megatron, DCP and ceilings.
#   part "gputests": only the GPU tests.
# Usage: bash benchmarks/gpu_suite.sh tests|gputests|bench|bench2|all   (results under $OUT)
#   env: PRESET=anchor|qwen3-4b-dp8, GIB (size per rank; empty: the preset's own), REPS, PEER_REPS, RESIDENCES, PEERS
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
PRESET_ARGS="--preset ${PRESET:-anchor}"
[ -n "${GIB-8.6}" ] && PRESET_ARGS="$PRESET_ARGS --gib ${GIB-8.6}"
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  python3 -m safe_ckpt.bench $PRESET_ARGS --reps ${REPS:-3} --peer-reps ${PEER_REPS:-2} \
    --targets "$SHM,$DISK" --cache cold,warm --peer-cache ${PEER_CACHE:-cold} --residences ${RESIDENCES:-gpu} \
    --peers ${PEERS:-all} --label "H200 ${PRESET:-anchor} one rank" --out "$OUT/bench_h200" > "$OUT/bench.log" 2>&1
  tail -3 "$OUT/bench.log"; grep '^|' "$OUT/bench_h200.md"
fi
# part "bench2": the same across the GPUs of one host (nvidia-h200-x2), one rank per GPU, with torchrun.
# (As Ray actors: `--ray-actors N` instead of torchrun; Ray is not on the GPU image and its wheel is too
#  large to carry, so that variant runs where Ray is installed.)
if [ "$PART" = bench2 ]; then
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  python3 -m torch.distributed.run --nproc-per-node "$NGPU" -m safe_ckpt.bench $PRESET_ARGS --reps ${REPS:-3} \
    --peer-reps ${PEER_REPS:-1} --targets "$SHM,$DISK" --cache cold --residences ${RESIDENCES:-gpu} \
    --peers ${PEERS:-all} --label "${NGPU}x H200 ${PRESET:-anchor}" --out "$OUT/bench_h200x$NGPU" > "$OUT/bench2.log" 2>&1
  tail -3 "$OUT/bench2.log"; grep '^|' "$OUT/bench_h200x$NGPU.md"
fi
