"""Publication of a checkpoint on a key-value store, where there is no rename.

One job: make a checkpoint written under a kvstore prefix visible only once every rank's
data is durable, with the small files as the commit marker. Data files carry the save's
id in their names, so a new save never overwrites the files of a previous checkpoint at
the same prefix. Commit order (rank 0): check that every data object of the save is there,
remove `metadata.json` (Megatron's "this is a checkpoint" marker) if a previous checkpoint
is there, then the common state, the manifest and `.metadata`, then `metadata.json` last;
finally the keys the new checkpoint does not use: the data files of the checkpoint it
replaced (those its `.metadata` named) and what dead saves of the prefix left (their
data files and owner objects), never a running save's. An interrupted save leaves no
`metadata.json`, which no loader takes for a checkpoint, and only keys this module
recognises as a save's (`is_save_leftover`): the next save of the prefix removes them,
and `safe-ckpt gc` does. Re-saving the same prefix is therefore not atomic on a kvstore
(the old checkpoint is gone once the commit starts): prefer a new prefix per iteration.

The last write is the commit. When the store does not confirm it (a timeout: the usual
ambiguous failure of an object store, whose PUT may have landed), the commit reads the
marker back: there, the checkpoint is committed and the save succeeds; absent, it failed;
unknown (the store does not answer), `AmbiguousCommitError`. `abort` checks the store before
it removes anything: where a `metadata.json` stands over an index naming this save's data
files, or the store cannot say, it removes none of them. Readers count a prefix complete only
when its index's data files are all there (`is_complete`): `root.iterations` (retention),
and `gc`, which removes a prefix whose marker stands over missing data once no running save
owns it.

A running save is announced by an owner object, `.safe_ckpt-owner-SAVEID`, written at plan
time, rewritten every `HEARTBEAT_S` by a thread of the saving process (a heartbeat), and
removed at publish or abort. It is live (`running_saves`) while it is younger than its own
staleness bound (`STALE_AFTER_S`, 60 s, as for directories; older records say what bound they
were written with), unless it names a process on this machine that has exited, which is
stale at once. `safe-ckpt gc` leaves a live save's keys alone; a new save of a prefix with a
live save is refused (one save per prefix at a time). The clocks of the hosts that share the
store must agree to well within the bound.

Must not: rely on rename or directories.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from ..directory.claim import Owner, _pid_running
from ...errors import CommitError
from ...names import CHECKPOINT_DIR, TRACKER_FILE, iteration_dir  # noqa: E402
from ...names import CONFIG_FILE, METADATA_FILE, OWNER_OBJECT, SMALL_FILES, TAGGED_DATA_FILE, file_tag, has_file_tag, owner_object, save_id_of  # noqa: F401 (save_id_of: callers know it from here)
from ...sinks.tensorstore import KvDeadlines, TensorStoreSink

log = logging.getLogger("safe_ckpt")

HEARTBEAT_S = 10.0  # how often a running save rewrites its owner object
STALE_AFTER_S = 60.0  # an owner object not rewritten this long belongs to a dead save
# Cleanup after a failure must not outlast the failure it cleans up after.
ABORT_REQUEST_TIMEOUT_S = 5.0
ABORT_BUDGET_S = 10.0
OWNER_STALE_S = STALE_AFTER_S  # the name older callers know
# save id -> the heartbeat of this process's running save (a record naming this process is live only if listed)
_heartbeats: dict = {}
_heartbeats_lock = threading.Lock()


def is_save_leftover(names) -> bool:
    """Keys only a safe_ckpt save of this prefix writes, and no `metadata.json`: what a killed
    or failed save leaves behind (a save still running looks the same)."""
    names = set(names)
    if not names or CONFIG_FILE in names:
        return False
    return only_ours(names)


def only_ours(names) -> bool:
    """Every key is one a safe_ckpt save writes (small files, tagged data files, owner objects)."""
    return all(n in SMALL_FILES or TAGGED_DATA_FILE.match(n) or OWNER_OBJECT.match(n) for n in names)


def owner_key(save_id: str) -> str:
    return owner_object(save_id)


def _record(save_id: str) -> bytes:
    here = Owner.here(save_id, "")
    return json.dumps({"save_id": save_id, "written_at_unix_s": time.time(), "stale_after_s": STALE_AFTER_S,
                       "heartbeat_s": HEARTBEAT_S, "pid": here.pid, "host": here.host,
                       "machine": here.machine}).encode()


class _Heartbeat:
    """Rewrites one save's owner object every `HEARTBEAT_S` until stopped."""

    def __init__(self, sink, save_id: str) -> None:
        self.sink, self.save_id = sink, save_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"safe_ckpt-kv-heartbeat-{save_id}")
        self._thread.start()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.sink.write_file(owner_key(self.save_id), _record(self.save_id))
            except Exception as exc:  # a passing fault must not stop it; a dead store fails the save anyway
                if not failing:
                    log.warning("cannot refresh %s%s (%s); retrying every %.0f s", self.sink.root,
                                owner_key(self.save_id), exc, HEARTBEAT_S)
                failing = True
                continue
            failing = False

    def stop(self) -> None:
        """Stop, and wait for a rewrite in flight (bounded by its request deadline): none may land
        after the owner object is removed."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.sink.deadlines.request_timeout_s + 1.0)


def claim(sink, save_id: str, save_timeout_s: float | None = None) -> None:
    """Announce a running save of this prefix (see the module docstring) and keep announcing it
    until `release`. (``save_timeout_s`` no longer matters: the heartbeat bounds staleness.)"""
    sink.write_file(owner_key(save_id), _record(save_id))
    beat = _Heartbeat(sink, save_id)
    with _heartbeats_lock:
        _heartbeats[save_id] = beat


def release(save_id: str) -> None:
    """Stop this process's heartbeat of ``save_id`` (idempotent); its owner object is removed by the caller."""
    with _heartbeats_lock:
        beat = _heartbeats.pop(save_id, None)
    if beat is not None:
        beat.stop()


def running_saves(sink, names, now_unix_s: float | None = None, force: bool = False) -> set[str]:
    """The save ids of ``names`` (a prefix's keys) whose owner object is live. An owner object
    that cannot be read counts as live: gc must not take a running save's files. ``force``: none
    is (the caller knows no save is running)."""
    if force:
        return set()
    now = time.time() if now_unix_s is None else now_unix_s
    out = set()
    for name in names:
        m = OWNER_OBJECT.match(name)
        if not m:
            continue
        try:
            live = _live(json.loads(sink.read(name)), now)
        except FileNotFoundError:
            live = False  # removed since the listing: its save ended
        except Exception as exc:
            log.warning("cannot read the owner object %s%s (%s); taking its save as running",
                        sink.root, name, exc)
            live = True
        if live:
            out.add(m.group(1))
    return out


def _live(record: dict, now: float) -> bool:
    if record.get("machine") and record.get("machine") == Owner.here("", "").machine:
        pid = int(record["pid"])
        if pid == Owner.here("", "").pid:
            return record.get("save_id") in _heartbeats  # this process: live while its save runs
        if not _pid_running(pid):
            return False  # a process on this machine that has exited
    return now - float(record["written_at_unix_s"]) < float(record["stale_after_s"])


class ForeignMetadataError(CommitError):
    """A prefix whose `.metadata` the restricted unpickler refuses: not a checkpoint this library
    may interpret or replace (its contents were not run)."""


class AmbiguousCommitError(CommitError):
    """The store did not confirm the commit's last write and could not be asked whether it landed."""


def referenced_files(sink) -> set[str]:
    """The data files the `.metadata` under ``sink`` names (empty if it cannot be fetched).
    A `.metadata` that is not a plain DCP index (a pickle naming other callables, garbage) is a
    `ForeignMetadataError`: it is read with the unpickler of `encoding.safe_read`, never `pickle`."""
    try:
        data = sink.read(METADATA_FILE)
    except Exception as exc:
        log.debug("cannot read %s%s: %s", sink.root, METADATA_FILE, exc)
        return set()
    return _index_files(sink, data)


def _index_files(sink, data: bytes) -> set[str]:
    from ...encoding.safe_read import UnreadableCheckpointError, metadata_from_bytes

    try:
        meta = metadata_from_bytes(data, f"{sink.root}{METADATA_FILE}")
    except UnreadableCheckpointError as exc:
        raise ForeignMetadataError(
            f"{exc}; {sink.root} is not a checkpoint safe_ckpt can interpret: remove its keys yourself, "
            "or use another prefix") from None
    return {info.relative_path for info in meta.storage_data.values()}


_complete_lock = threading.Lock()
# (root, endpoint, keys) -> verdict: a prefix's index is read once while its keys stay the same
_complete_seen: dict = {}
_COMPLETE_SEEN_MAX = 4096


def is_complete(sink, names) -> bool:
    """Whether the prefix of ``sink`` (its keys ``names``) is a complete checkpoint: `metadata.json`
    and `.metadata`, and every data file the index names. An index that cannot be read or is
    refused: not complete (never counted, never taken for one)."""
    names = frozenset(names)
    if CONFIG_FILE not in names or METADATA_FILE not in names:
        return False
    key = (sink.root, getattr(getattr(sink, "location", None), "endpoint", None), names)
    with _complete_lock:
        if key in _complete_seen:
            return _complete_seen[key]
    try:
        data = sink.read(METADATA_FILE)
        referenced = _index_files(sink, data)
    except ForeignMetadataError:
        verdict = False
    except Exception as exc:  # cannot tell now: not counted, and not remembered
        log.warning("cannot read %s%s (%s); not counting it as a checkpoint", sink.root, METADATA_FILE, exc)
        return False
    else:
        verdict = bool(referenced) and referenced <= names
    with _complete_lock:
        if len(_complete_seen) >= _COMPLETE_SEEN_MAX:
            _complete_seen.clear()
        _complete_seen[key] = verdict
    return verdict


def check_target(sink, replace: str) -> None:
    keys = sink.list()
    held = sorted({k.split("/", 1)[0] for k in keys
                   if k == TRACKER_FILE or ("/" in k and CHECKPOINT_DIR.match(k.split("/", 1)[0]))})
    if held:  # whatever the policy: replacing a save root would delete every checkpoint in it
        raise CommitError(
            f"{sink.root} is a save root (it holds {', '.join(held[:3])}{' and more' if len(held) > 3 else ''}): "
            "saving into it would replace every checkpoint it holds. Save to an iteration prefix inside it, "
            f"e.g. {sink.root.rstrip('/')}/{iteration_dir(0)} (safe_ckpt.megatron.save_state names it and writes "
            "the tracker)")
    if not keys or replace == "any":
        return
    live = running_saves(sink, keys)
    if live:
        raise CommitError(
            f"another save of {sink.root} is running (save {', '.join(sorted(live))}: its owner object is fresh); "
            f"one save per prefix at a time. If that save is dead, its owner object goes stale {STALE_AFTER_S:.0f} s "
            f"after its last heartbeat (at once where its process ran on this machine and has exited); "
            f"`safe-ckpt gc --force` removes it now")
    complete = METADATA_FILE in keys and CONFIG_FILE in keys
    if replace == "never":
        raise CommitError(f"{sink.root} is not empty and SaveOptions(replace='never') forbids replacing it")
    if is_save_leftover(keys):
        log.info("%s holds %d key(s) an interrupted save left (no metadata.json); this save "
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
    then remove what the new checkpoint does not use, and the save's ``owner`` object."""
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
    _write_marker(sink, small_files[CONFIG_FILE])
    own_id = save_id_of(owner) if owner is not None else None
    if own_id is not None:
        release(own_id)  # no heartbeat may write the owner object again
    _remove_unused(sink, set(small_files) | set(data_files), replaced, own_id)
    if owner is not None:
        _remove_owner(sink, owner)


def _write_marker(sink, marker: bytes) -> None:
    """The commit's last write. Unconfirmed, the store is asked whether it landed (see the module docstring)."""
    try:
        sink.write_file(CONFIG_FILE, marker)
        return
    except Exception as exc:
        failure = exc
    try:
        landed = sink.read(CONFIG_FILE) == marker
    except FileNotFoundError:
        landed = False
    except Exception as exc:
        raise AmbiguousCommitError(
            f"{sink.root}{CONFIG_FILE}: the store did not confirm the commit's last write ({failure}), and cannot "
            f"be asked whether it landed ({exc}). Its data objects are kept: `safe-ckpt verify {sink.root}` tells "
            "whether it is a whole checkpoint; `safe-ckpt gc` removes it if it is not") from failure
    if not landed:
        raise failure
    log.warning("the store did not confirm %s%s (%s), but it is there: the checkpoint is committed",
                sink.root, CONFIG_FILE, failure)


def _remove_unused(sink, used: set[str], replaced: set[str], own_id: str | None) -> None:
    """The keys the new checkpoint does not use: the replaced checkpoint's data files, and what
    saves that are not running left (a killed save's data and owner objects)."""
    try:
        names = set(sink.list())
        running = running_saves(sink, names) - {own_id}
    except Exception as exc:
        log.warning("could not list %s to remove what the new checkpoint does not use: %s; "
                    "`safe-ckpt gc` removes it", sink.root, exc)
        return
    for name in sorted(names - used):
        save_id = save_id_of(name)
        if name == owner_key(own_id or ""):
            continue
        if name in replaced or (save_id is not None and save_id not in running):
            try:
                sink.delete(name)
            except Exception as exc:  # harmless: nothing references it, and gc removes it
                log.warning("could not remove %s%s, which the new checkpoint does not use: %s",
                            sink.root, name, exc)


def _remove_owner(sink, owner: str) -> None:
    try:
        sink.delete(owner)
    except Exception as exc:  # harmless: it goes stale, and gc removes it then
        log.warning("could not remove %s%s: %s", sink.root, owner, exc)


def abort(sink: TensorStoreSink, tag: str) -> None:
    """Remove the data files this save wrote, its owner object, and the small files of its commit
    if that was cut short before the marker (best effort, within `ABORT_BUDGET_S`: the store may
    be the reason the save failed). Checked first: where the store shows this save's commit (a
    `metadata.json` over an index naming its data files), or cannot be asked, no data file is
    removed."""
    save_id = tag.lstrip("-")
    release(save_id)
    quick = TensorStoreSink(sink.location, KvDeadlines(ABORT_REQUEST_TIMEOUT_S, time.monotonic() + ABORT_BUDGET_S))
    try:
        names = quick.list()
        ours = METADATA_FILE in names and _commits(quick, tag)
        if CONFIG_FILE in names and ours:
            log.warning("%s holds this save's commit (metadata.json over its index): its data files "
                        "are kept; `safe-ckpt verify %s` tells whether it is whole", sink.root, sink.root)
            _remove_owner(quick, owner_key(save_id))
            return
        # The small files of a commit cut short before its marker (its index names this save's files).
        small = [n for n in SMALL_FILES if n in names and n != CONFIG_FILE] if ours else []
        for name in small + [n for n in sorted(names) if has_file_tag(n, tag) or n == owner_key(save_id)]:
            quick.delete(name)
    except Exception as exc:
        log.warning("could not remove the failed save's data files under %s (%s); "
                    "`safe-ckpt gc` removes them later", sink.root, exc)


def _commits(sink, tag: str) -> bool:
    """Whether the prefix's index names this save's data files; True where that cannot be read."""
    try:
        data = sink.read(METADATA_FILE)
    except FileNotFoundError:
        return False
    try:
        return any(has_file_tag(name, tag) for name in _index_files(sink, data))
    except ForeignMetadataError:
        return False


def new_file_tag(save_id: str) -> str:
    if not save_id:
        raise CommitError("internal error: no save id for kvstore file names")
    return file_tag(save_id)
