set -u
T0=$SECONDS; PARTS=${PARTS:-load,tests}
bash benchmarks/gpu_suite.sh none >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD; export PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE "H[0-9]+")
C=${C:-unknown}; R=$OUT/r; mkdir -p $R; cp /tmp/safe_ckpt_results/machine.txt $R/ 2>/dev/null
pack() { tar czf $OUT/r.tgz -C $OUT r; }
PT="python3 -m pytest -q -p no:cacheprovider -W ignore::UserWarning -W ignore::FutureWarning -m gpu -rA --durations=12"
echo "== setup $((SECONDS-T0)) s $GPU parts $PARTS"
if [[ $PARTS == *load* ]]; then rm -rf /dev/shm/lq
timeout ${LOAD_S:-150} python3 benchmarks/load_bench.py --preset qwen3-4b-dp8 --threads ${THREADS:-16} --reps ${REPS:-3} --methods ${METHODS:-ceiling,ceiling_gpu,safe,safe_nosum,safe_torchcopy} ${PROFILE:---profile} --commit $C --target /dev/shm/lq/load --out $R/load_${LOADNAME:-qwen_diag} > $R/load_qwen.log 2>&1
echo "load bench rc $? at $((SECONDS-T0)) s"; rm -rf /dev/shm/lq
grep -E '^(\||safe)' $R/load_${LOADNAME:-qwen_diag}.md 2>/dev/null | cut -c1-330 || tail -5 $R/load_qwen.log; pack
fi
if [[ $PARTS == *tests* ]]; then
timeout ${TEST_S:-200} $PT -n 8 ${TESTS:-tests/gpu/test_copy_window_on_gpu.py tests/gpu/test_load_into_gpu.py} > $R/gpu_tests.log 2>&1; echo "tests rc $? at $((SECONDS-T0)) s"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error|assert" $R/gpu_tests.log | tail -30 | cut -c1-220; pack
fi
if [[ $PARTS == *zs* ]]; then rm -rf /dev/shm/zs
timeout ${ZS_S:-250} python3 benchmarks/zero_stall_bench.py --variant gpu --modes ${ZS_MODES:-overlap,safe_async} --saves ${SAVES:-4} --target /dev/shm/zs --out $R/zero_stall_${ZSNAME:-cur} ${ZSPROF:-} --label "$GPU: training step cost of a checkpoint save (commit $C)" > $R/zero_stall.log 2>&1
echo "zs bench rc $? at $((SECONDS-T0)) s"; rm -rf /dev/shm/zs
if [ -e $R/zero_stall_${ZSNAME:-cur}.md ]; then grep -E "^(\||Same run)" $R/zero_stall_${ZSNAME:-cur}.md | cut -c1-400; else grep -v -i warn $R/zero_stall.log | tail -12 | cut -c1-250; fi; pack
fi
if [[ $PARTS == *steps* ]]; then rm -rf /dev/shm/ls
timeout ${STEPS_S:-120} python3 benchmarks/diag/load_steps.py --target /dev/shm/ls --gib ${STEPS_GIB:-0.05} --reps 7 --threads 16 > $R/load_steps.log 2>&1
echo "load steps rc $? at $((SECONDS-T0)) s"; rm -rf /dev/shm/ls; grep -v -i warn $R/load_steps.log | tail -25 | cut -c1-200; pack
fi
if [[ $PARTS == *anchor* ]]; then rm -rf /dev/shm/la
timeout ${ANCHOR_S:-120} python3 benchmarks/load_bench.py --preset anchor --threads 16 --reps ${REPS:-3} --methods ${AMETHODS:-ceiling,ceiling_gpu,safe,safe_gilfree,safe_nosum} --commit $C --target /dev/shm/la/load --out $R/load_anchor_${LOADNAME:-cur} > $R/load_anchor.log 2>&1
echo "anchor load rc $? at $((SECONDS-T0)) s"; rm -rf /dev/shm/la
grep -E '^(\||safe)' $R/load_anchor_${LOADNAME:-cur}.md 2>/dev/null | cut -c1-330 || tail -5 $R/load_anchor.log; pack
fi
