"""Publication of a checkpoint on a key-value store, where there is no rename.

One job: make a checkpoint written under a kvstore prefix visible only once every rank's
data is durable, with the small files as the commit marker. Data files carry the save's
id in their names, so a new save never overwrites the files of a previous checkpoint at
the same prefix. Commit order (rank 0): remove `metadata.json` (Megatron's "this is a
checkpoint" marker) if a previous checkpoint is there, then the common state, the
manifest and `.metadata`, then `metadata.json` last; finally the data files of the
checkpoint it replaced (those its `.metadata` named), and no others: files of another
save of the same prefix are not this save's to remove. An interrupted save leaves no
`metadata.json`, which no loader takes for a checkpoint, and only keys this module
recognises as a save's (`is_save_leftover`): the next save of the prefix replaces them,
and `safe-ckpt gc` removes them. Re-saving the same prefix is therefore not atomic on a
kvstore (the old checkpoint is gone once the commit starts): prefer a new prefix per
iteration.

A running save is announced by an owner object, `.safe_ckpt-owner-SAVEID`, written at plan
time and removed at publish or abort: `safe-ckpt gc` leaves the data files of a save whose
owner object is fresh alone. It is not refreshed; instead it records its own staleness bound,
generous enough for any save to finish: twice the save's `kvstore_save_timeout_s`, or
`OWNER_STALE_S` (a day) for a save without one. A killed save's owner object is stale after
that, and gc then removes it with the save's files.

Must not: rely on rename or directories.
"""

from __future__ import annotations

import json
import logging
import re
import time

from .errors import CommitError
from .sinks.tensorstore import KvDeadlines, TensorStoreSink

log = logging.getLogger("safe_ckpt")

METADATA_FILE = ".metadata"
CONFIG_FILE = "metadata.json"
# What a save writes besides its data files (the manifest and the common state are optional).
SMALL_FILES = (METADATA_FILE, CONFIG_FILE, "common.pt", "safe_ckpt_manifest.json")
# A data file of one save: `__RANK_INDEX-SAVEID.distcp` (see `new_file_tag`).
_TAGGED_DATA = re.compile(r"^__\d+_\d+-[0-9a-f]{8,}\.distcp$")
# The record of a running save (see the module docstring); its suffix is the save's id.
OWNER_PREFIX = ".safe_ckpt-owner-"
_OWNER = re.compile(r"^\.safe_ckpt-owner-([0-9a-f]{8,})$")
OWNER_STALE_S = 24 * 3600.0
# Cleanup after a failure must not outlast the failure it cleans up after.
ABORT_REQUEST_TIMEOUT_S = 5.0
ABORT_BUDGET_S = 10.0


def is_save_leftover(names) -> bool:
    """Keys only a safe_ckpt save of this prefix writes, and no `metadata.json`: what a killed
    or failed save leaves behind (a save still running looks the same)."""
    names = set(names)
    if not names or CONFIG_FILE in names:
        return False
    return all(n in SMALL_FILES or _TAGGED_DATA.match(n) or _OWNER.match(n) for n in names)


def owner_key(save_id: str) -> str:
    return OWNER_PREFIX + save_id


def claim(sink, save_id: str, save_timeout_s: float | None) -> None:
    """Announce a running save of this prefix to `safe-ckpt gc` (see the module docstring)."""
    stale_after_s = OWNER_STALE_S if save_timeout_s is None else max(2 * save_timeout_s, 600.0)
    sink.write_file(owner_key(save_id), json.dumps(
        {"save_id": save_id, "written_at_unix_s": time.time(), "stale_after_s": stale_after_s}).encode())


def running_saves(sink, names, now_unix_s: float | None = None) -> set[str]:
    """The save ids of ``names`` (a prefix's keys) whose owner object is fresh. An owner object
    that cannot be read counts as fresh: gc must not take a running save's files."""
    now = time.time() if now_unix_s is None else now_unix_s
    out = set()
    for name in names:
        m = _OWNER.match(name)
        if not m:
            continue
        try:
            record = json.loads(sink.read(name))
            fresh = now - float(record["written_at_unix_s"]) < float(record["stale_after_s"])
        except Exception as exc:
            log.warning("safe_ckpt: cannot read the owner object %s%s (%s); taking its save as running",
                        sink.root, name, exc)
            fresh = True
        if fresh:
            out.add(m.group(1))
    return out


def save_id_of(name: str) -> str | None:
    """The save id in a data file's or an owner object's name."""
    m = _OWNER.match(name)
    if m:
        return m.group(1)
    if _TAGGED_DATA.match(name):
        return name[:-len(".distcp")].rsplit("-", 1)[1]
    return None


class ForeignMetadataError(CommitError):
    """A prefix whose `.metadata` the restricted unpickler refuses: not a checkpoint this library
    may interpret or replace (its contents were not run)."""


def referenced_files(sink) -> set[str]:
    """The data files the `.metadata` under ``sink`` names (empty if it cannot be fetched).
    A `.metadata` that is not a plain DCP index (a pickle naming other callables, garbage) is a
    `ForeignMetadataError`: it is read with the unpickler of `tools.safe_load`, never `pickle`."""
    from .tools.safe_load import UnreadableCheckpointError, metadata_from_bytes

    try:
        data = sink.read(METADATA_FILE)
    except Exception as exc:
        log.debug("safe_ckpt: cannot read %s%s: %s", sink.root, METADATA_FILE, exc)
        return set()
    try:
        meta = metadata_from_bytes(data, f"{sink.root}{METADATA_FILE}")
    except UnreadableCheckpointError as exc:
        raise ForeignMetadataError(
            f"{exc}; {sink.root} is not a checkpoint safe_ckpt can interpret: remove its keys yourself, "
            "or use another prefix") from None
    return {info.relative_path for info in meta.storage_data.values()}


def check_target(sink, replace: str) -> None:
    keys = sink.list()
    if not keys or replace == "any":
        return
    complete = METADATA_FILE in keys and CONFIG_FILE in keys
    if replace == "never":
        raise CommitError(f"{sink.root} is not empty and SaveOptions(replace='never') forbids replacing it")
    if is_save_leftover(keys):
        log.info("safe_ckpt: %s holds %d key(s) an interrupted save left (no metadata.json); this save "
                 "replaces them (`safe-ckpt gc` removes them)", sink.root, len(keys))
        return
    if not complete:
        raise CommitError(
            f"{sink.root} holds keys but no complete torch_dist checkpoint (foreign data or a broken save); "
            "refusing to replace it. Remove them, or pass SaveOptions(replace='any')"
        )
    referenced_files(sink)  # a `.metadata` it may not read: refused now, not after the data is written


def publish(sink, small_files: dict[str, bytes], data_files: set[str], owner: str | None = None) -> None:
    """Write the small files (``.metadata`` and ``metadata.json`` in ``small_files``) in commit order,
    then remove the save's ``owner`` object."""
    existing = set(sink.list())
    missing = sorted(set(data_files) - existing)
    if missing:
        # Something removed this save's data before its commit (e.g. `safe-ckpt gc` on the prefix
        # while the save ran): publishing would make an index of missing files.
        raise CommitError(
            f"{sink.root}{missing[0]}: {len(missing)} data file(s) of this save are missing at commit "
            f"(removed while the save ran, e.g. by `safe-ckpt gc` on the prefix); nothing was published. "
            "Do not run gc on a prefix a save is writing, and save again")
    replaced: set[str] = set()
    if CONFIG_FILE in existing:
        replaced = referenced_files(sink) & existing  # ForeignMetadataError: refused before anything changes
        sink.delete(CONFIG_FILE)
    for name, data in small_files.items():
        if name not in (METADATA_FILE, CONFIG_FILE):
            sink.write_file(name, data)
    sink.write_file(METADATA_FILE, small_files[METADATA_FILE])
    sink.write_file(CONFIG_FILE, small_files[CONFIG_FILE])
    for name in sorted(replaced - set(data_files)):
        try:
            sink.delete(name)
        except Exception as exc:  # a leftover data file is harmless: nothing references it
            log.warning("safe_ckpt: could not remove %s%s of the replaced checkpoint: %s", sink.root, name, exc)
    if owner is not None:
        _remove_owner(sink, owner)


def _remove_owner(sink, owner: str) -> None:
    try:
        sink.delete(owner)
    except Exception as exc:  # harmless: it goes stale, and gc removes it then
        log.warning("safe_ckpt: could not remove %s%s: %s", sink.root, owner, exc)


def abort(sink: TensorStoreSink, tag: str) -> None:
    """Remove the data files this save wrote (best effort, within `ABORT_BUDGET_S`: the store
    may be the reason the save failed)."""
    quick = TensorStoreSink(sink.location, KvDeadlines(ABORT_REQUEST_TIMEOUT_S, time.monotonic() + ABORT_BUDGET_S))
    try:
        for name in quick.list():
            if name.endswith(f"{tag}.distcp") or name == owner_key(tag.lstrip("-")):
                quick.delete(name)
    except Exception as exc:
        log.warning("safe_ckpt: could not remove the failed save's data files under %s (%s); "
                    "`safe-ckpt gc` removes them later", sink.root, exc)


def new_file_tag(save_id: str) -> str:
    if not save_id:
        raise CommitError("internal error: no save id for kvstore file names")
    return f"-{save_id}"
