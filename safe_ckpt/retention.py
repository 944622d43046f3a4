"""Retention of iteration directories for the Megatron entry point.

One job: after a new checkpoint is committed (and the tracker points at it), decide
which older `iter_XXXXXXX` directories to keep (the last N, every K-th, the current
one and the one the tracker names) and remove the rest, each through a hidden rename
so that a crash never leaves a half-deleted directory under an iteration's name. Runs
on one rank only, so it is safe on a filesystem the ranks share.
Must not: touch anything before the commit, or anything that is not an iteration dir.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from .commit import remove_checkpoint

log = logging.getLogger("safe_ckpt")
_ITER = re.compile(r"^iter_(\d{7,})$")


@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None  # the newest N iterations
    keep_every: int | None = None  # plus every iteration divisible by K

    @property
    def active(self) -> bool:
        return bool(self.keep_last) or bool(self.keep_every)


def iterations(save_dir: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(save_dir):
        m = _ITER.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out[int(m.group(1))] = os.path.join(save_dir, name)
    return out


def to_remove(found: list[int], current: int, policy: Retention) -> list[int]:
    if not policy.active:
        return []
    keep = {current}
    if policy.keep_last:
        keep.update(sorted(found)[-policy.keep_last:])
    if policy.keep_every:
        keep.update(i for i in found if i % policy.keep_every == 0)
    if not policy.keep_last:
        keep.update(i for i in found if i > current)  # only keep_every: never touch newer ones
    return sorted(i for i in found if i not in keep)


def prune(save_dir: str, current: int, policy: Retention) -> list[int]:
    """Remove what `policy` does not keep; returns the removed iterations (failures are logged)."""
    found = iterations(save_dir)
    removed = []
    for it in to_remove(list(found), current, policy):
        try:
            remove_checkpoint(found[it])
            removed.append(it)
        except OSError as exc:
            log.warning("safe_ckpt: could not remove old checkpoint %s: %s", found[it], exc)
    if removed:
        log.info("safe_ckpt: retention removed iterations %s", removed)
    return removed
