#!/usr/bin/env bash
# Run the stock-load round-trip tests once per supported (Python, torch, megatron-core) cell,
# each in its own venv under .compat/, and print a table of cell -> pass/fail (also written
# to .compat/results.md, or $COMPAT_OUT).
#
#   scripts/compat.sh                  # every cell below whose Python is on this machine
#   scripts/compat.sh 3.11:2.13.0:0.15.3 3.12:2.13.0:0.19.2   # chosen cells, PY:TORCH:MCORE
#   COMPAT_TESTS=tests/format/test_megatron_integrity_manifest.py scripts/compat.sh 3.12:2.13.0:0.19.2   # integrity.json vs stock
#
# Each (Python, torch) pair gets one venv holding torch (.compat/torch-pyPY-TORCH); each cell's
# venv sees it through a .pth file and installs only megatron-core and the test tools, so a
# multi-GB torch is unpacked once per Python. Python 3.11 takes torch 2.13.0 from this machine's
# wheel directory; other Pythons download PyPI's (CUDA) build, which the tests run on the CPU.
# CI runs one cell (scripts/test.sh); this script is for checking the others by hand.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${COMPAT_DIR:-$ROOT/.compat}
OUT=${COMPAT_OUT:-$DIR/results.md}
# tests/format/test_megatron_integrity_manifest.py: where megatron-core has --verify-integrity (0.18+), stock
# load(..., verify_integrity=True) checks safe_ckpt's integrity.json (CI's 0.16 cell cannot).
TESTS=${COMPAT_TESTS:-tests/format/test_stock_loaders_read_every_layout.py tests/integrations/test_megatron_adapters.py tests/format/test_megatron_integrity_manifest.py}
CELL_TIMEOUT_S=${COMPAT_TIMEOUT_S:-3600}  # a cell took 18-26 minutes on a loaded 2-core machine
DEFAULT_CELLS=(
  3.11:2.13.0:0.15.3
  3.11:2.13.0:0.16.1
  3.12:2.13.0:0.17.1
  3.12:2.13.0:0.18.2
  3.12:2.13.0:0.19.2
)
CELLS=("$@")
[ ${#CELLS[@]} -gt 0 ] || CELLS=("${DEFAULT_CELLS[@]}")
mkdir -p "$DIR"

find_python() {  # an interpreter of version $1 (X.Y): on PATH, else under pyenv
  local v=$1 p
  for p in "$(command -v "python$v" 2>/dev/null)" "$HOME"/.pyenv/versions/"$v".*/bin/python; do
    if [ -n "$p" ] && [ -x "$p" ] && "$p" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$v')" 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  return 1
}

site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

torch_env() {  # the venv holding torch $2 for Python $1, made once; prints its path
  local py=$1 torch=$2 env="$DIR/torch-py$1-$2" interp
  if [ ! -f "$env/.ready" ]; then
    interp=$(find_python "$py") || return 1
    rm -rf "$env" && "$interp" -m venv "$env" || return 1
    "$env/bin/pip" install -q "torch==$torch" >"$env.log" 2>&1 || return 1
    touch "$env/.ready"
  fi
  echo "$env"
}

run_cell() {  # prints one table row: | cell | Python | torch | megatron-core | result | tests | time |
  local py=$1 torch=$2 mcore=$3 cell="py$1-torch$2-mcore$3" env base log versions summary rc t0 t1
  env="$DIR/$cell"; log="$DIR/$cell.log"
  : >"$log"
  if ! base=$(torch_env "$py" "$torch"); then
    echo "| $cell | $py | $torch | $mcore | not run: no Python $py or torch $torch install failed (see $DIR/torch-py$py-$torch.log) | | |"
    return
  fi
  if [ ! -f "$env/.ready" ]; then
    rm -rf "$env" && "$base/bin/python" -m venv "$env" >>"$log" 2>&1
    site_packages "$base" >"$(site_packages "$env")/compat_torch.pth"
    if ! "$env/bin/pip" install -q "megatron-core==$mcore" pytest pytest-timeout numpy xxhash packaging >>"$log" 2>&1; then
      echo "| $cell | $py | $torch | $mcore | not run: install failed (see $log) | | |"
      return
    fi
    touch "$env/.ready"
  fi
  versions=$("$env/bin/python" -c '
import platform, torch
from importlib.metadata import version
print(platform.python_version(), torch.__version__, version("megatron-core"))' 2>>"$log")
  read -r v_py v_torch v_mcore <<<"$versions"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$ROOT" && PYTHONPATH="$ROOT" timeout "$CELL_TIMEOUT_S" "$env/bin/python" -m pytest -q -p no:cacheprovider $TESTS) >>"$log" 2>&1
  rc=$?
  t1=$(date +%s)
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* in ' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  [ $rc -eq 124 ] && summary="timed out after ${CELL_TIMEOUT_S}s"
  echo "| $cell | ${v_py:-?} | ${v_torch:-?} | ${v_mcore:-?} | $([ $rc -eq 0 ] && echo pass || echo FAIL) | ${summary:-see $log} | $((t1 - t0)) s |"
}

{
  tree=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)
  [ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ] || tree="$tree with uncommitted changes"
  echo "Stock-load round trip across versions, $(date -u +%Y-%m-%d), safe_ckpt at $tree"
  echo "Tests: $TESTS"
  echo
  echo "| cell | Python | torch | megatron-core | result | tests | time |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
} | tee "$OUT"
status=0
for spec in "${CELLS[@]}"; do
  IFS=: read -r py torch mcore <<<"$spec"
  row=$(run_cell "$py" "$torch" "$mcore")
  echo "$row" | tee -a "$OUT"
  case "$row" in *"| pass |"*) ;; *) status=1 ;; esac
done
echo "table written to $OUT"
exit $status
