"""Retention of iteration checkpoints for the Megatron entry point, on any target.

One job: after a new checkpoint is committed (and the tracker points at it), decide
which older `iter_XXXXXXX` checkpoints to keep and remove the rest through the save root's
`Target` (`survey`, `remove_checkpoint`: never a half-deleted checkpoint under an
iteration's name). Runs on one rank only, so it is safe on a filesystem the ranks share.

The rules: only complete checkpoints (`.metadata` and `metadata.json`) are candidates
for removal, anything else is somebody's data. Iterations newer than the current one
(left by an abandoned run that a resumed one is overwriting) are not counted toward
`keep_last` and are removed only with `Retention(remove_newer=True)`; without it they
are reported (as what a rollback skipped where the run resumed from an older one). The
current checkpoint and the ones the run resumed from are never removed. Symbolic links are
reported and left alone.
Must not: touch anything before the commit, or anything that is not a complete iteration dir.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import CheckpointError
from .base import Target
from .registry import resolve

log = logging.getLogger("safe_ckpt")


@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None  # the newest N iterations up to the current one
    keep_every: int | None = None  # plus every iteration divisible by K
    remove_newer: bool = False  # remove complete iterations newer than the current one too

    @property
    def active(self) -> bool:
        return bool(self.keep_last) or bool(self.keep_every)


def _kept_for_resume(resumed_from) -> frozenset:
    """``resumed_from`` (one iteration, several, or None) as a set."""
    if resumed_from is None:
        return frozenset()
    if isinstance(resumed_from, int):
        return frozenset({resumed_from})
    return frozenset(resumed_from)


def to_remove(found: list[int], current: int, policy: Retention, resumed_from=None) -> list[int]:
    """Which of the complete checkpoints ``found`` the policy removes; ``resumed_from`` (an
    iteration or a collection of them: what the run loaded) is never removed."""
    if not policy.active:
        return []
    older = sorted(i for i in found if i <= current)
    keep = {current} | _kept_for_resume(resumed_from)
    if policy.keep_last:
        keep.update(older[-policy.keep_last:])
    if policy.keep_every:
        keep.update(i for i in found if i % policy.keep_every == 0)
    if not policy.remove_newer:
        keep.update(i for i in found if i > current)
    return sorted(i for i in found if i not in keep)


def report_newer(newer: list[int], current: int, policy: Retention, resumed_from=None) -> None:
    """Say what retention does with complete iterations newer than the current one. Newer than
    the checkpoint the run resumed from, they are what a rollback skipped (`--ckpt-step` to an
    earlier iteration): a diverged run's, which only the user may delete."""
    if not newer or not policy.active:
        return
    what = ("removes them (Retention(remove_newer=True))" if policy.remove_newer else
            "keeps them, does not count them toward keep-last, and never removes them unless told to "
            "(Retention(remove_newer=True)); delete them yourself once they are not needed")
    resumed = sorted(i for i in _kept_for_resume(resumed_from) if i < min(newer))
    if resumed:
        log.warning("iterations %s are newer than iteration %d, which this run resumed from, and than "
                    "the current %d: the run went back past them (a --ckpt-step rollback), so they belong to the "
                    "abandoned line; retention %s", newer, resumed[-1], current, what)
    else:
        log.warning("iterations %s are newer than the current %d (left by an earlier run?); retention %s",
                    newer, current, what)


def prune(save_root, current: int, policy: Retention, resumed_from=None) -> list[int]:
    """Remove what `policy` does not keep; returns the removed iterations (failures are logged).
    ``save_root``: a `Target` or a local path; ``resumed_from``: the iteration(s) the run loaded
    from this save root."""
    root = save_root if isinstance(save_root, Target) else resolve(save_root)
    with root.bounded() as r:  # one deadline for the survey and every removal
        found = r.survey()
        report_newer(sorted(i for i in found.complete if i > current), current, policy, resumed_from)
        if found.links and policy.active:
            log.info("retention leaves symbolic links alone: %s", sorted(found.links.values()))
        if found.incomplete and policy.active:
            log.info("retention leaves directories that hold no complete checkpoint alone: %s",
                     sorted(found.incomplete.values()))
        removed = []
        for it in to_remove(list(found.complete), current, policy, resumed_from):
            try:
                r.remove_checkpoint(found.complete[it])
                removed.append(it)
            except (OSError, CheckpointError) as exc:
                log.warning("could not remove old checkpoint %s: %s", r.shown(found.complete[it]), exc)
    if removed:
        log.info("retention removed iterations %s", removed)
    return removed
