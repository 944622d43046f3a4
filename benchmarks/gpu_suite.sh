#!/usr/bin/env bash
# The whole GPU suite on the GPU machine (see benchmarks/README.md), in parts that each fit a 10-minute run:
#   tests    gputests, then smoke;
#   gputests the GPU save tests (tests/gpu/test_device_saves.py and test_slime_offloaded_actors.py: round
#            trips per residence, profiler counts, unmapped memory, torch_memory_saver, pool reuse, real
#            GPTModel resume, slime actors);
#   asleep   the asleep-save GPU tests (GPU_K), then slimeloop;
#   slimeloop benchmarks/slime_loop_bench.py: stock, awake and asleep saves in slime's loop, tmpfs and disk
#            (LOOP_TARGETS, REPS rounds, TWEAKS: the asleep save with one setting changed, LOOP_TAG);
#   slimereal slime's own save_model (SLIME_SRC=.slime, from scripts/export_slime.sh) on a real GPTModel;
#   slimeshipped slime as it ships (.slime; its Megatron patch's DDP buffers on a patched copy of megatron-core,
#            its args, torch_memory_saver preloaded): the asleep save and one --release-train cycle, then slimemodes
#            (MODES=0 skips it);
#   load     benchmarks/load_bench.py: safe_ckpt.load beside stock Megatron, DCP and the read ceiling into GPU
#            templates, tmpfs and disk (LOAD_TARGETS, LOAD_PRESETS, LOAD_N ranks sharing the GPU, LOAD_REPS,
#            LOAD_GIB, LOAD_QWEN_GIB, LOAD_METHODS, LOAD_DISK, LOAD_COMMIT); loadtests: the GPU load tests;
#   slimemodes benchmarks/slime_modes_bench.py: per-step checkpoint cost in --offload-train and --release-train,
#            stock against safe_ckpt (REPS rounds, MODES_TARGET, default tmpfs; MODES_LIST: which modes);
#   smoke    a 1 GiB benchmark of every peer with memcpy counts, and the same as one Ray actor;
#   bench    the 8+ GB benchmark, all on the GPU, tmpfs and disk, beside stock Megatron, DCP and ceilings
#            (the TensorStore sink is in smoke: 9 GB through it takes 15 s a run on tmpfs);
#   mixes    the same state with optimizer state in pinned and in pageable host memory, and the
#            qwen3-4b-dp8 preset, on tmpfs;
#   bench2   the bench part across every GPU of the host (nvidia-h200-x2 or larger), one rank per GPU
#            (the DP=8 run: PRESET=qwen3-4b-dp8 GIB= on 8 GPUs);
#   node     a node's save on the one GPU: N ranks sharing it (torchrun --nproc-per-node N, every rank on
#            device 0, gloo) for N in NODE_NS (default "1 2 4 8"), the anchor preset's NODE_TOTAL_GIB (8.6) split
#            N ways, every peer beside, on each of TARGETS (default tmpfs; tmpfs for every N takes about
#            10 minutes, disk about 6 minutes per two N: NODE_NS="1 2", then "4 8"); see benchmarks/node_bench.md;
#   resume   the real-GPT DistributedOptimizer resume test (and the NCCL-default-group save) with one
#            data-parallel rank per GPU of the host;
#   gil      benchmarks/diag/gil_handoffs.py on tmpfs and disk: what giving up the GIL costs the issuing
#            thread beside 16 writers, and what nicer writers change (~30 s);
#   diag     where time goes: benchmarks/diag/diag_ttd.py (anchor, then qwen3-4b-dp8) and diag_staging.py;
#   diagvs   the anchor diag cases of this tree beside another commit's (VS_TREE, VS_ROUNDS);
#   zerostall the copy-window GPU tests (tests/gpu/test_copy_window_on_gpu.py: the window core, and the
#            Megatron drop-in's --safe-ckpt-overlap-copy: bit-exact resume through stock load_checkpoint and
#            the profiler's H2D/NCCL counts, both variants), then zerostallbench; zerostalltests alone: the tests;
#   zerostallbench benchmarks/zero_stall_bench.py, variants gpu and cpu_offload on tmpfs (ZS_TARGET), each
#            ~2-4 minutes: this overlap mode, today's async save, DCP async_save, stock Megatron --async-save;
#   cpu      the CPU suite on this machine's Python / megatron-core (from .whl).
# Usage: bash benchmarks/gpu_suite.sh PART [PART ...]   (results under $OUT)
#   env: PRESET=anchor|qwen3-4b-dp8, GIB (size per rank; empty: the preset's own), REPS, PEER_REPS, PEERS,
#        THREADS (writer threads of every saver and the ceiling, default 8), CACHE (bench: cold,warm),
#        ONLY, ONLY_QWEN (diag_ttd cases of the anchor / qwen3-4b-dp8 runs), DIAG_ANCHOR=0, DIAG_QWEN=0, DIAG_STAGING=0,
#        DIAG_TARGET (the anchor run's directory, default tmpfs), DIAG_TAG (suffix of its result files),
#        GPU_N (pytest-xdist workers for the GPU tests), GPU_K (pytest -k), PART_LIMIT_S (see below)
set -uo pipefail
cd "$(dirname "$0")/.."
# Results go to $RES; after each part they are packed into $OUT/results.tgz (only a few files
# come back from $OUT), so a part cut short still returns what the others wrote.
OUT=${OUT:-/tmp/safe_ckpt_gpu_out}
RES=${RES:-/tmp/safe_ckpt_results}
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1
SITE=/tmp/site; mkdir -p "$SITE"
# Installed once per machine and set of carried files: a later run on the same machine with
# the same .whl/ skips it. Ray, too large for a wheel in one run's files, travels as an xz tarball
# of the installed tree. The marker is written only once every step succeeded.
SIG=$(stat -c '%n %s' .whl/* 2>/dev/null | sha1sum | cut -c1-40)
if [ -d .whl ] && [ "$(cat "$SITE/.safe_ckpt_installed" 2>/dev/null)" != "$SIG" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || exit 1
  fi
  for t in .whl/*.tar.xz; do
    if [ -e "$t" ]; then tar -xJf "$t" -C "$SITE" || exit 1; fi
  done
  echo "$SIG" > "$SITE/.safe_ckpt_installed"
fi
export PYTHONPATH=$SITE:$PWD
# Megatron-LM's megatron.training (not on PyPI), for the real-model tests: carried as .mlm/
[ -d .mlm/megatron/training ] && export PYTHONPATH=$PWD/.mlm:$PYTHONPATH
DISK=${DISK:-/tmp/safe_ckpt_bench}
SHM=${SHM:-/dev/shm/safe_ckpt_bench}
# PART_LIMIT_S: a time limit on each Python run of a part, so that a run cut short leaves the
# shell to pack what it recorded (a `timeout` around this whole script kills the packing too;
# a bench cut short is reported from its rows with `python -m safe_ckpt_lab.bench --rebuild PREFIX`).
PY=python3
# the labels name the GPU the run found (H100 and H200 machines both serve these runs)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE "H[0-9]+" || echo GPU)
[ -n "${PART_LIMIT_S:-}" ] && PY="timeout $PART_LIMIT_S python3"
PYTEST="$PY -m pytest -q -p no:cacheprovider -W ignore::UserWarning -W ignore::FutureWarning"
GIB_ARG=""
[ -n "${GIB-8.6}" ] && GIB_ARG="--gib ${GIB-8.6}"
BENCH="$PY -m safe_ckpt_lab.bench --preset ${PRESET:-anchor} $GIB_ARG"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" 2>/dev/null
  python3 -c "import ray; print('ray', ray.__version__)" 2>/dev/null
  python3 -c "import torch_memory_saver as t; print('torch_memory_saver', getattr(t, '__version__', 'present'))" 2>/dev/null
  echo "cores $(getconf _NPROCESSORS_ONLN)"; free -g; df -hT /tmp /dev/shm; uname -r
  lscpu | grep -m1 'Model name'
  grep -m1 -E '^(cpu family|model)\s' /proc/cpuinfo; grep -m1 '^model\s' /proc/cpuinfo
  # the kernel's copy into the page cache uses fast strings where these flags are set
  grep -m1 -ow -E 'fsrm|erms' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  for f in enabled shmem_enabled; do echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>/dev/null)"; done
  grep -E ' /dev/shm | / ' /proc/mounts; lscpu | grep -i numa
} > "$RES/machine.txt" 2>&1

part_cpu() {
  $PYTEST -m "not gpu" tests --slow --timeout 600 > "$RES/cpu_suite_on_gpu_box.log" 2>&1
  tail -3 "$RES/cpu_suite_on_gpu_box.log"
}

part_gputests() {
  # GPU_N: pytest-xdist workers sharing the one GPU (every test spawns its own processes anyway)
  $PYTEST -m gpu tests/gpu/test_device_saves.py tests/gpu/test_slime_offloaded_actors.py -rA --durations=20 --timeout 400 \
    ${GPU_N:+-n $GPU_N} ${GPU_K:+-k "$GPU_K"} > "$RES/gpu_tests.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$RES/gpu_tests.log" | tail -30
}

part_smoke() {
  $PY -m safe_ckpt_lab.bench --gib 1 --reps 3 --peer-reps 1 --targets "$SHM" --cache cold --count-h2d --ceiling-beside-d2h \
    --peers safe_sync,safe_async,safe_sync_nosum,safe_sync_tensorstore,megatron_sync,megatron_async,dcp_sync,dcp_async_pinned \
    --label "$GPU 1 GiB, memcpy counts" --out "$RES/bench_smoke" > "$RES/bench_smoke.log" 2>&1
  grep '^|' "$RES/bench_smoke.md" | head -12
  # slime's launch shape: the harness as a Ray actor holding the GPU
  $PY -m safe_ckpt_lab.bench --ray-actors 1 --gib 1 --reps 3 --peer-reps 1 --targets "$SHM" \
    --peers safe_sync,safe_async,dcp_sync --label "$GPU 1 GiB, one Ray actor" --out "$RES/bench_ray" \
    > "$RES/bench_ray.log" 2>&1
  tail -2 "$RES/bench_ray.log"; grep '^|' "$RES/bench_ray.md" | head -6
}

part_tests() { part_gputests; part_smoke; }

# slime's colocated loop: the asleep GPU tests (GPU_K narrows them), then the three ways to save
# the same 9 GB state side by side (benchmarks/slime_loop_bench.py), on tmpfs and disk.
part_asleep() {
  $PYTEST -m gpu tests/gpu/test_slime_offloaded_actors.py -k "${GPU_K:-asleep}" -rA -s --timeout 400 > "$RES/gpu_asleep_tests.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|asleep save" "$RES/gpu_asleep_tests.log" | cut -c1-400 | tail -12
  part_slimeloop
}

# slime's own save_model (its source exported into .slime/ by scripts/export_slime.sh) on a real GPTModel
part_slimereal() {
  SLIME_SRC=$PWD/.slime $PYTEST -m gpu tests/gpu/test_real_slime_source.py -rA -s --timeout 400 > "$RES/slime_real_src.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|evidence" "$RES/slime_real_src.log" | cut -c1-700 | tail -12
}

# slime as it ships: tests/gpu/test_real_slime_source.py's shipped-configuration and release-train tests, then the
# two-mode measurement. SLIME_MEGATRON_PATCH: slime's docker/patch/latest/megatron.patch, tried before the port.
part_slimeshipped() {
  SLIME_SRC=$PWD/.slime $PYTEST -m gpu tests/gpu/test_real_slime_source.py -k "shipped_configuration or release_train" \
    -rA -s --timeout 400 > "$RES/slime_shipped.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|evidence|slime megatron patch" "$RES/slime_shipped.log" \
    | cut -c1-1200 | tail -12
  tar -czf "$OUT/results.tgz" -C "$RES" .
  [ "${MODES:-1}" = 1 ] && part_slimemodes
}

part_slimemodes() {
  $PY benchmarks/slime_modes_bench.py --slime-src .slime ${MODES_LIST:+--modes "$MODES_LIST"} --rounds ${REPS:-2} --target "${MODES_TARGET:-$SHM/slime_modes}" \
    ${SLIME_MEGATRON_PATCH:+--megatron-patch "$SLIME_MEGATRON_PATCH"} --out "$RES/slime_modes" > "$RES/slime_modes.log" 2>&1
  echo "slime_modes_bench rc $?"; grep -E "^\||^row|slime megatron patch|Error|State per" "$RES/slime_modes.log" | tail -24 | cut -c1-400
}

# Loading (benchmarks/load_bench.py): safe_ckpt.load against stock Megatron load, DCP load and the read
# ceiling (the same threads reading the same files) into GPU templates, every load bit-exact: the anchor
# state (LOAD_GIB GiB, default 8: 8.59 GB) and one qwen3-4b-dp8 rank (1217 shards) on one rank, then LOAD_N
# ranks sharing the GPU (the anchor split N ways, each rank loading its own files, against the N-rank
# ceiling), on each of LOAD_TARGETS: "tmpfs" ($SHM, warm) and "disk" (LOAD_DISK, default
# /var/tmp/safe_ckpt_load on the real disk, the page cache dropped before every run: drop_caches where
# allowed, else posix_fadvise; the report says which). About 8 minutes with the defaults on one H100;
# shrink with LOAD_TARGETS (e.g. tmpfs), LOAD_PRESETS, LOAD_N (1: no multi-rank run), LOAD_REPS (default
# REPS, 3), LOAD_METHODS, LOAD_GIB, LOAD_QWEN_GIB (a smaller qwen3-4b-dp8 rank, its 1217 shards kept).
# LOAD_COMMIT names the commit measured (the GPU machine's copy has no git).
part_load() {
  local T tag cold pre size n=${LOAD_N:-8} th=${THREADS:-16} gib=${LOAD_GIB:-8}
  local common="--reps ${LOAD_REPS:-${REPS:-3}} --methods ${LOAD_METHODS:-ceiling,ceiling_gpu,safe,safe_nosum,stock,dcp}"
  [ -n "${LOAD_COMMIT:-}" ] && common="$common --commit $LOAD_COMMIT"
  for T in ${LOAD_TARGETS:-tmpfs disk}; do
    case "$T" in
      tmpfs) T=$SHM; tag=tmpfs; cold="" ;;
      disk) T=${LOAD_DISK:-/var/tmp/safe_ckpt_load}; tag=disk; cold=--cold ;;
      *) tag=tmpfs; cold=""; [ "$T" != "$SHM" ] && { tag=disk; cold=--cold; } ;;
    esac
    for pre in ${LOAD_PRESETS:-anchor qwen3-4b-dp8}; do
      size="--gib $gib"
      [ "$pre" != anchor ] && size="${LOAD_QWEN_GIB:+--gib $LOAD_QWEN_GIB --keep-shards}"
      $PY benchmarks/load_bench.py --preset "$pre" $size --threads "$th" $common $cold \
        --target "$T/load" --out "$RES/load_${pre}_1rank_$tag" > "$RES/load_${pre}_1rank_$tag.log" 2>&1
      echo "load $pre 1 rank $tag rc $?"; grep -E '^(\||# Load|Host)' "$RES/load_${pre}_1rank_$tag.md" | cut -c1-400
      tar -czf "$OUT/results.tgz" -C "$RES" .
    done
    if [ "$n" -gt 1 ]; then
      $PY benchmarks/load_bench.py --preset anchor --gib "$(python3 -c "print(round($gib/$n, 3))")" --ranks "$n" \
        --share-gpu --threads $(( th / n > 0 ? th / n : 1 )) $common $cold \
        --target "$T/load" --out "$RES/load_anchor_${n}ranks_$tag" > "$RES/load_anchor_${n}ranks_$tag.log" 2>&1
      echo "load anchor $n ranks $tag rc $?"; grep -E '^(\||# Load)' "$RES/load_anchor_${n}ranks_$tag.md" | cut -c1-400
      tar -czf "$OUT/results.tgz" -C "$RES" .
    fi
    rm -rf "$T/load"
  done
}

part_loadtests() {
  $PYTEST -m gpu tests/gpu/test_load_into_gpu.py -rA -s --timeout 600 > "$RES/gpu_load_tests.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$RES/gpu_load_tests.log" | tail -8
}

part_slimeloop() {
  $PY benchmarks/slime_loop_bench.py --targets "${LOOP_TARGETS:-$SHM/slime_loop,$DISK/slime_loop}" --rounds ${REPS:-2} \
    ${TWEAKS+--tweaks "$TWEAKS"} --out "$RES/slime_loop${LOOP_TAG:+_$LOOP_TAG}" > "$RES/slime_loop${LOOP_TAG:+_$LOOP_TAG}.log" 2>&1
  echo "slime_loop_bench rc $?"; grep -v "^ \|^\[" "$RES/slime_loop${LOOP_TAG:+_$LOOP_TAG}.log" | tail -40 | cut -c1-600
}

part_gil() {
  local t
  for t in "$SHM" "$DISK"; do
    $PY benchmarks/diag/gil_handoffs.py --writers ${THREADS:-16} --target "${t}_gil" --rounds ${REPS:-5}
  done > "$RES/gil_handoffs.txt" 2>&1
  grep case "$RES/gil_handoffs.txt" | cut -c1-160
}

part_diag() {
  DIAG_TAG=${DIAG_TAG:+_$DIAG_TAG}
  if [ "${DIAG_ANCHOR:-1}" = 1 ]; then
    $PY benchmarks/diag/diag_ttd.py --preset anchor --gib 8.6 --reps ${REPS:-3} --target "${DIAG_TARGET:-$SHM}" \
      ${ONLY:+--only "$ONLY"} > "$RES/diag_ttd_anchor$DIAG_TAG.txt" 2> "$RES/diag_ttd_anchor$DIAG_TAG.err"
    grep case "$RES/diag_ttd_anchor$DIAG_TAG.txt" | cut -c1-500
  fi
  [ "${DIAG_QWEN:-1}" = 1 ] || return 0
  $PY benchmarks/diag/diag_ttd.py --preset qwen3-4b-dp8 --gib "" --reps ${REPS:-3} --target "$SHM" \
    --only "${ONLY_QWEN:-write_8,d2h,pipe*,safe_sync,safe_async}" > "$RES/diag_ttd_qwen$DIAG_TAG.txt" \
    2> "$RES/diag_ttd_qwen$DIAG_TAG.err"
  grep case "$RES/diag_ttd_qwen$DIAG_TAG.txt" | cut -c1-500
  [ "${DIAG_STAGING:-1}" = 1 ] || return 0
  $PY benchmarks/diag/diag_staging.py --target "$SHM" > "$RES/diag_staging.txt" 2> "$RES/diag_staging.err"
  cat "$RES/diag_staging.txt" | cut -c1-200
}

# The anchor diag cases of this tree and of another commit's tree, alternating, one process each
# round (VS_ROUNDS, default 2), so the machine's drift hits both alike. The other tree: VS_TREE
# (default .vs), exported with `git archive REV safe_ckpt benchmarks | tar -x -C .vs` and carried.
part_diagvs() {
  local vs=${VS_TREE:-.vs} out="$RES/diag_ttd_vs${DIAG_TAG:+_$DIAG_TAG}.txt" round tree
  [ -d "$vs/safe_ckpt" ] || { echo "no tree at $vs"; return 1; }
  : > "$out"
  for round in $(seq "${VS_ROUNDS:-2}"); do
    for tree in . "$vs"; do
      # older trees kept the diag scripts directly under benchmarks/
      local script=benchmarks/diag/diag_ttd.py
      [ -e "$tree/$script" ] || script=benchmarks/diag_ttd.py
      (cd "$tree" && PYTHONPATH=$SITE:$PWD $PY "$script" --preset anchor --gib "${GIB-8.6}" \
        --reps "${REPS:-3}" --target "${DIAG_TARGET:-$SHM}" ${ONLY:+--only "$ONLY"} 2>/dev/null) \
        | grep '"case"' | sed "s|^|{\"tree\": \"$tree\", \"round\": $round, \"row\": |; s|\$|}|" >> "$out"
    done
  done
  grep -v '"trace"' "$out" | cut -c1-300
}

# TARGETS: the targets of one run (default both; tmpfs and disk with every peer at 3 runs and
# the per-round ceilings take about 10 minutes, so run TARGETS=$SHM and TARGETS=$DISK separately).
part_bench() {
  $BENCH --reps ${REPS:-5} --peer-reps ${PEER_REPS:-3} --targets "${TARGETS:-$SHM,$DISK}" --cache ${CACHE:-cold,warm} \
    --peer-cache cold --residences gpu --ceiling-each-rep --ceiling-beside-d2h --threads ${THREADS:-8} \
    --peers ${PEERS:-safe_sync,safe_async,safe_sync_nosum,megatron_sync,megatron_async,dcp_sync,dcp_async_pinned} \
    --label "$GPU ${PRESET:-anchor} one rank" --out "$RES/bench_h200" > "$RES/bench.log" 2>&1
  tail -3 "$RES/bench.log"; grep '^|\|^Write ceiling\|^write_beside' "$RES/bench_h200.md"
}

part_mixes() {
  $BENCH --reps ${REPS:-3} --peer-reps ${PEER_REPS:-3} --targets "$SHM" --cache cold,warm --peer-cache cold \
    --threads ${THREADS:-8} --residences opt-pinned,opt-pageable --peers ${PEERS:-safe_sync,safe_async,safe_sync_nosum,megatron_sync,dcp_sync,dcp_async_pinned} \
    --label "$GPU ${PRESET:-anchor} one rank, host-resident optimizer state" --out "$RES/bench_mixes" \
    > "$RES/bench_mixes.log" 2>&1
  tail -2 "$RES/bench_mixes.log"; grep '^|' "$RES/bench_mixes.md"
  $PY -m safe_ckpt_lab.bench --preset qwen3-4b-dp8 --reps 3 --peer-reps 2 --targets "$SHM" --cache cold \
    --threads ${THREADS:-8} --residences gpu --peers safe_sync,safe_async,megatron_sync,dcp_sync \
    --label "$GPU qwen3-4b-dp8 one rank" --out "$RES/bench_qwen" > "$RES/bench_qwen.log" 2>&1
  tail -2 "$RES/bench_qwen.log"; grep '^|' "$RES/bench_qwen.md"
}

# The bench part across the GPUs of one host, one rank per GPU, with torchrun. (As Ray actors:
# `--ray-actors N` instead of torchrun, with Ray carried as in the tests part.)
part_bench2() {
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  $PY -m torch.distributed.run --nproc-per-node "$NGPU" -m safe_ckpt_lab.bench --preset ${PRESET:-anchor} $GIB_ARG \
    --reps ${REPS:-3} --peer-reps ${PEER_REPS:-3} --targets "$SHM,$DISK" --cache cold --residences gpu \
    --threads ${THREADS:-8} \
    --peers ${PEERS:-all} --label "${NGPU}x H200 ${PRESET:-anchor}" --out "$RES/bench_h200x$NGPU" > "$RES/bench2.log" 2>&1
  tail -3 "$RES/bench2.log"; grep '^|' "$RES/bench_h200x$NGPU.md"
}

# One torchrun per N and target; results $RES/node_<tmpfs|disk>_<N>ranks.{json,md,log}. A compact line per
# N (medians, ceilings, each rank's device-to-host share, what safe_ckpt resolved) and its goals.
#   THREADS: default 0 (safe_ckpt on the library's per-host defaults; the stock peers and the ceiling on
#            cores / N); NODE_BUDGET: "state" (default: each rank's pool holds its GPU bytes + 0.25 GiB, so an
#            async save's stall is its device-to-host copy), "lib" (the library's default pool), or GiB;
#   REPS (3), PEER_REPS (1), CEILING_REPS (tmpfs 3, disk 2), NODE_BESIDE (1 on tmpfs: the ceiling beside N
#   device-to-host copies, which the tmpfs goal needs; 0 elsewhere), PEERS, NODE_PRESET (anchor, or
#   qwen3-4b-dp8 at its own per-rank size: NODE_TOTAL_GIB is then ignored).
#   NODE_ONE_RUN=1: one torchrun per N over every target of TARGETS (tmpfs and disk in one run, one start,
#   one state; the ceiling beside the copies on tmpfs only); results $RES/node_tmpfs+disk_<N>ranks.*
part_node() {
  local tgt n fs per size budget beside creps prefix t0 rc preset=${NODE_PRESET:-anchor} targets=${TARGETS:-$SHM}
  local runs=${targets//,/ }
  [ "${NODE_ONE_RUN:-0}" = 1 ] && runs=$targets
  for tgt in $runs; do
    case "$tgt" in *,*) fs=tmpfs+disk ;; /dev/shm*) fs=tmpfs ;; *) fs=disk ;; esac
    for n in ${NODE_NS:-1 2 4 8}; do
      per=$(python3 -c "print(round(${NODE_TOTAL_GIB:-8.6} / $n, 4))")  # GiB per rank, all on the GPU
      size="--gib $per"
      [ "$preset" = anchor ] || { size=""; per=6.56; }  # qwen3-4b-dp8: its own 7.04 GB (6.56 GiB) per rank
      case "${NODE_BUDGET:-state}" in
        lib) budget="" ;;
        state) budget="--budget-gib $(python3 -c "print(round($per + 0.25, 4))")" ;;
        *) budget="--budget-gib $NODE_BUDGET" ;;
      esac
      beside=""  # by default beside the copies on tmpfs only (where they bind); NODE_BESIDE=1: every target
      [ -z "${NODE_BESIDE:-}" ] && [ $fs != disk ] && beside="--ceiling-beside-d2h tmpfs"
      [ "${NODE_BESIDE:-}" = 1 ] && beside="--ceiling-beside-d2h"
      creps=${CEILING_REPS:-$([ $fs = tmpfs ] && echo 3 || echo 2)}
      prefix="$RES/node_${fs}_${n}ranks${NODE_TAG:+_$NODE_TAG}"
      t0=$(date +%s)
      $PY -m torch.distributed.run --standalone --nproc-per-node "$n" -m safe_ckpt_lab.bench --preset "$preset" $size \
        --reps ${REPS:-3} --peer-reps ${PEER_REPS:-1} --targets "$tgt" --cache cold --peer-cache cold \
        --residences gpu --threads ${THREADS:-0} $budget --ceiling-each-rep --ceiling-reps "$creps" $beside \
        --peers ${PEERS:-safe_sync,safe_async,dcp_sync,dcp_async_pinned,megatron_sync,megatron_async} \
        --label "$GPU, $n rank(s) on one GPU, $preset, $per GiB per rank, $fs" --out "$prefix" \
        > "$prefix.log" 2>&1
      rc=$?
      echo "node N=$n $fs: rc $rc, $(( $(date +%s) - t0 )) s"
      if [ $rc -ne 0 ]; then
        grep -v -i warn "$prefix.log" | tail -4 | cut -c1-300
        if [ -e "$prefix.meta.json" ] && [ ! -e "$prefix.md" ]; then  # cut short: its report from its rows
          python3 -m safe_ckpt_lab.bench --rebuild "$prefix" > "$prefix.rebuilt.log" 2>&1
          echo "  report rebuilt from its recorded rows:"
          grep -E '^(node|goals) N=' "$prefix.rebuilt.log" | cut -c1-700
          tar -czf "$OUT/results.tgz" -C "$RES" .
          continue
        fi
      fi
      grep -E '^(node|goals) N=' "$prefix.log" | cut -c1-700
      tar -czf "$OUT/results.tgz" -C "$RES" .  # after each N: a part cut short keeps the runs before it
    done
  done
}

# Every GPU test: the real-slime cases that compare the device's free memory before and after
# a save run alone after the others (workers sharing the GPU change that number).
part_subset() {
  local alone="test_real_slime_save_model_saves_asleep or test_real_slime_in_its_shipped_configuration"
  SLIME_SRC=${SLIME_SRC:-$PWD/.slime} $PYTEST -m gpu tests/gpu -n 6 -k "not ($alone)" -rA --timeout 370 --durations=8 \
    > "$RES/gpu_subset_parallel.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$RES/gpu_subset_parallel.log" | tail -12
  SLIME_SRC=${SLIME_SRC:-$PWD/.slime} $PYTEST -m gpu tests/gpu/test_real_slime_source.py -k "$alone" -rA --timeout 190 \
    > "$RES/gpu_subset_alone.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$RES/gpu_subset_alone.log" | tail -6
}

part_resume() {
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  SAFE_CKPT_GPU_WORLD=$NGPU $PYTEST -m gpu tests/gpu/test_device_saves.py -k "real_gpt or default_group_nccl" -rA --durations=5 --timeout 600 \
    > "$RES/gpu_resume_dp$NGPU.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$RES/gpu_resume_dp$NGPU.log" | tail -8
}

part_zerostalltests() {
  $PYTEST -m gpu tests/gpu/test_copy_window_on_gpu.py -rA --durations=10 --timeout 400 \
    > "$RES/zero_stall_tests.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$RES/zero_stall_tests.log" | tail -15
}

part_zerostallbench() {
  ZS_TARGET=${ZS_TARGET:-/dev/shm/safe_ckpt_zs}
  for variant in gpu cpu_offload; do
    rm -rf "$ZS_TARGET"; t0=$(date +%s)
    $PY benchmarks/zero_stall_bench.py --variant $variant --target "$ZS_TARGET" --out "$RES/zero_stall_$variant" \
      --label "$GPU: training step cost of a checkpoint save, variant $variant" > "$RES/zero_stall_$variant.log" 2>&1
    echo "zero_stall $variant: rc $?, $(( $(date +%s) - t0 )) s"
    grep -E "^(calibrated|baseline)" "$RES/zero_stall_$variant.log" | cut -c1-300
    if [ -e "$RES/zero_stall_$variant.md" ]; then grep '^|' "$RES/zero_stall_$variant.md"
    else grep -v -i warn "$RES/zero_stall_$variant.log" | tail -5 | cut -c1-300; fi
    rm -rf "$ZS_TARGET"
    tar -czf "$OUT/results.tgz" -C "$RES" .
  done
}

part_zerostall() { part_zerostalltests; part_zerostallbench; }

[ $# -eq 0 ] && set -- tests
for part in "$@"; do
  case "$part" in
    cpu|gputests|smoke|tests|subset|asleep|slimereal|slimeshipped|slimemodes|load|loadtests|slimeloop|gil|bench|mixes|bench2|node|resume|diag|diagvs|zerostall|zerostalltests|zerostallbench) echo "== $part $(date +%T)"; "part_$part" ;;
    all) part_tests; part_bench; part_mixes ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
  tar -czf "$OUT/results.tgz" -C "$RES" .
done
echo "== done $(date +%T)"
