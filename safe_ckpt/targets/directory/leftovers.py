"""The hidden siblings of a checkpoint directory, and what to do with those a save left.

One job: name the hidden directories beside a target (`.<name>.safe_ckpt-staging-<id>`,
`-replaced-`, `-deleting-`; a name too long for that is shortened and hashed), tell what a
leftover is and which target it belongs to, and apply the recovery rules that
`safe_ckpt.targets.directory.publish`'s docstring states (`sweep`). Used by `commit.prepare` for one target
and by `safe-ckpt gc` for a whole directory.
Must not: remove a running save's staging directory, or the only complete copy of a checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field

from .claim import STALE_AFTER_S, liveness, read_owner
from ...names import CONFIG_FILE, DELETING_MARK, HIDDEN, LEFTOVER_MARKS, METADATA_FILE, REPLACED_MARK, SAVE_ID_CHARS, STAGING_MARK
from ...sinks.posix import fsync_path

log = logging.getLogger(__name__)

_NAME_MAX_BYTES = 255  # NAME_MAX of Linux filesystems
# A base name longer than this would push its hidden siblings' names past NAME_MAX.
_BASE_MAX_BYTES = _NAME_MAX_BYTES - 1 - max(len(m) for m in LEFTOVER_MARKS) - SAVE_ID_CHARS
_HASHED = re.compile(r"~[0-9a-f]{16}$")


def hidden_base(name: str) -> str:
    """The part of a target's name its hidden siblings carry: the name itself, or for a name
    too long for that, a prefix and a hash of the whole name."""
    if len(os.fsencode(name)) <= _BASE_MAX_BYTES:
        return name
    prefix = name[:_BASE_MAX_BYTES - 17]
    while len(os.fsencode(prefix)) > _BASE_MAX_BYTES - 17:
        prefix = prefix[:-1]
    return f"{prefix}~{hashlib.sha256(os.fsencode(name)).hexdigest()[:16]}"


def hidden_path(final_dir: str, mark: str, save_id: str) -> str:
    parent, name = os.path.split(os.path.abspath(final_dir).rstrip(os.sep))
    return os.path.join(parent, f".{hidden_base(name)}{mark}{save_id}")


def staging_dir_for(final_dir: str, save_id: str) -> str:
    return hidden_path(final_dir, STAGING_MARK, save_id)


def is_complete_checkpoint(path: str) -> bool:
    """A published torch_dist checkpoint has both its index and its config."""
    return os.path.isfile(os.path.join(path, METADATA_FILE)) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def leftovers_of(final_dir: str) -> list[str]:
    """Staging / replaced / deleting directories an interrupted save of this target left behind."""
    parent, name = os.path.split(os.path.abspath(final_dir).rstrip(os.sep))
    prefix = f".{hidden_base(name)}{HIDDEN}"
    try:
        return sorted(os.path.join(parent, n) for n in os.listdir(parent)
                      if n.startswith(prefix) and any(n[len(prefix) - len(HIDDEN):].startswith(m) for m in LEFTOVER_MARKS))
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class Leftover:
    path: str
    mark: str
    save_id: str
    target: str | None  # the checkpoint's path, where it can be told


def parse_leftover(path: str) -> Leftover | None:
    """What a hidden directory named by safe_ckpt is; None for any other name."""
    parent, name = os.path.split(path)
    for mark in LEFTOVER_MARKS:
        at = name.rfind(mark)
        if name.startswith(".") and at > 1:
            base, save_id = name[1:at], name[at + len(mark):]
            return Leftover(path, mark, save_id, _target_of(parent, base, save_id))
    return None


def _target_of(parent: str, base: str, save_id: str) -> str | None:
    if not _HASHED.search(base):
        return os.path.join(parent, base)
    owner = read_owner(os.path.join(parent, f".{base}{STAGING_MARK}{save_id}"))
    if owner is not None:
        return os.path.join(parent, os.path.basename(owner.target))
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    return next((os.path.join(parent, n) for n in names if not n.startswith(".") and hidden_base(n) == base), None)


@dataclass(frozen=True)
class Sweep:
    """What `sweep` did (or, with ``dry_run``, would do)."""

    removed: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)  # target names given back their checkpoint
    live: list[str] = field(default_factory=list)  # "path: why" of running saves' directories, left alone
    kept: list[str] = field(default_factory=list)  # "path: why" of leftovers that may hold the only copy


def sweep(paths: list[str], dry_run: bool = False, stale_after_s: float = STALE_AFTER_S) -> Sweep:
    """Recover from and clear the leftovers at ``paths`` (see the module docstring for the rules)."""
    out = Sweep()
    found = [x for x in map(parse_leftover, paths) if x is not None]
    order = {REPLACED_MARK: 0, STAGING_MARK: 1, DELETING_MARK: 2}
    for item in sorted(found, key=lambda x: (order[x.mark], x.path)):
        if not os.path.lexists(item.path):
            continue
        if item.mark == DELETING_MARK:
            _remove(item.path, dry_run, out)
            continue
        parent, name = os.path.split(item.path)
        staging = os.path.join(parent, name.replace(item.mark, STAGING_MARK, 1) if item.mark != STAGING_MARK else name)
        state = liveness(staging, stale_after_s) if os.path.isdir(staging) else None
        if state is not None and state.live:
            out.live.append(f"{item.path}: {state.why}")
        elif item.mark == STAGING_MARK:
            _remove(item.path, dry_run, out)
        elif item.target is None:
            out.kept.append(f"{item.path}: cannot tell which checkpoint name it belongs to; rename it back by hand")
        elif not os.path.lexists(item.target):
            log.warning("%s restored from %s, which a save interrupted while replacing it left",
                        item.target, item.path)
            if not dry_run:
                os.rename(item.path, item.target)
                fsync_path(parent, directory=True)
            out.restored.append(item.target)
        elif is_complete_checkpoint(item.target) or not is_complete_checkpoint(item.path):
            _remove(item.path, dry_run, out)
        else:
            out.kept.append(f"{item.path}: the only complete checkpoint of {item.target}, which holds an "
                            "incomplete one; compare them and remove one by hand")
    for line in out.kept:
        log.warning("kept %s", line)
    return out


def _remove(path: str, dry_run: bool, out: Sweep) -> None:
    if not dry_run:
        log.info("removing %s left by an interrupted save", path)
        if os.path.isdir(path) and not os.path.islink(path):
            doomed = _doomed(path)
            if doomed is not None:
                shutil.rmtree(doomed, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if os.path.lexists(path):
            log.warning("could not remove %s", path)
            return
    out.removed.append(path)


def _doomed(path: str) -> str | None:
    """Rename a directory about to be removed to a `-deleting-` name first: a removal cut short
    then never leaves a half-deleted directory under a name a save could publish or restore."""
    parent, name = os.path.split(path)
    if DELETING_MARK in name:
        return path
    item = parse_leftover(path)
    base = name[1:name.rfind(item.mark)] if item is not None else name.lstrip(".")
    doomed = os.path.join(parent, f".{base}{DELETING_MARK}{uuid.uuid4().hex[:SAVE_ID_CHARS]}")
    try:
        os.rename(path, doomed)
    except OSError as exc:
        log.warning("cannot rename %s to %s before removing it (%s); leaving it", path, doomed, exc)
        return None
    return doomed
