#!/usr/bin/env bash
# Export the part of a slime git directory that tests/gpu/test_real_slime_source.py imports (the `slime`
# package, nothing else) into a plain folder, with a COMMIT file naming the commit, so the test can
# say which slime ran when SLIME_SRC points at the export rather than at a checkout.
# Fetches nothing: give it a slime git directory (a clone or a bare mirror) you already have.
#   scripts/export_slime.sh /path/to/slime/.git-or-bare-repo [DEST=.slime] [REV=HEAD]
# The export is third-party source: keep DEST out of git (e.g. `/.slime/` in .git/info/exclude).
set -euo pipefail
src=${1:?usage: scripts/export_slime.sh SLIME_GIT_DIR [DEST] [REV]}
dest=${2:-.slime}
rev=${3:-HEAD}
commit=$(git -C "$src" rev-parse "$rev^{commit}")
if [ -e "$dest" ] && [ ! -f "$dest/COMMIT" ] && [ -n "$(ls -A "$dest")" ]; then
  echo "refusing to replace $dest: it is not an earlier export (no COMMIT file)" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
git -C "$src" archive "$commit" slime | tar -x -C "$dest"
git -C "$src" log -1 --format='%H %cI' "$commit" > "$dest/COMMIT"
echo "exported slime $(cat "$dest/COMMIT") to $dest ($(du -sh "$dest" | cut -f1))"
