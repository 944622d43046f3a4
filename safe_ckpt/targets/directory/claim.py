"""Who owns a staging directory, and whether that owner is still running.

One job: the process that creates a staging directory marks it as its own (an owner
record naming host, process and save id, whose modification time is a heartbeat, plus an
advisory `flock` on the directory) for as long as its save runs; anyone about to remove
a staging directory (`safe-ckpt gc`, another save of the same target) asks `liveness`
first. The rule for a stale owner is in `safe_ckpt.targets.directory.publish`'s docstring.
Must not: remove anything, or decide what a leftover is (that is `commit`'s job).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass

from ...names import OWNER_FILE

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # how often a running save touches its owner record
STALE_AFTER_S = 60.0  # an owner record untouched this long belongs to a dead save
# errnos of a filesystem that has no advisory locks: the owner record alone decides
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
# save id -> this process's unreleased claims: a record naming this process is live only if
# listed (a failed save that never released its claim must not block the next one)
_held: "weakref.WeakValueDictionary[str, Claim]" = weakref.WeakValueDictionary()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class Owner:
    """The save that created a staging directory. ``machine`` is hostname, boot id and pid
    namespace together: only where all three match is the pid one this process can probe."""

    save_id: str
    target: str
    pid: int
    host: str
    machine: str

    @staticmethod
    def here(save_id: str, target: str) -> "Owner":
        host = socket.gethostname()
        machine = f"{host}/{_read('/proc/sys/kernel/random/boot_id')}/{_pid_namespace()}"
        return Owner(save_id, target, os.getpid(), host, machine)

    def on_this_machine(self) -> bool:
        return self.machine == Owner.here(self.save_id, self.target).machine


def read_owner(staging_dir: str) -> Owner | None:
    """The owner record of ``staging_dir``; None if it has none or it cannot be read."""
    try:
        with open(os.path.join(staging_dir, OWNER_FILE)) as f:
            return Owner(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _read(f"/proc/{pid}/stat")
    return not stat or stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]  # a zombie has exited


def _locked(path: str) -> bool:
    """Whether some process holds the directory's `flock` (False where locks are unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Liveness:
    live: bool
    why: str


def liveness(staging_dir: str, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> Liveness:
    """Whether the save that created ``staging_dir`` may still be running (see `commit`)."""
    owner = read_owner(staging_dir)
    if owner is not None and owner.pid == os.getpid() and owner.on_this_machine():
        mine = _held.get(owner.save_id)
        if mine is not None and mine.held:
            return Liveness(True, f"save {owner.save_id} of this process is running")
        return Liveness(False, f"save {owner.save_id} of this process is over")
    if _locked(staging_dir):
        return Liveness(True, "locked by the process saving into it")
    try:
        age_s = (time.time() if now is None else now) - os.stat(os.path.join(staging_dir, OWNER_FILE)).st_mtime
    except OSError:
        return Liveness(False, "no owner record")
    if owner is None:
        return Liveness(False, "unreadable owner record")
    who = f"save {owner.save_id} of process {owner.pid} on {owner.host}"
    if owner.on_this_machine() and not _pid_running(owner.pid):
        return Liveness(False, f"{who}: that process has exited")
    if age_s >= stale_after_s:
        return Liveness(False, f"{who}: last heartbeat {age_s:.0f} s ago (stale after {stale_after_s:.0f} s)")
    return Liveness(True, f"{who}, last heartbeat {max(age_s, 0):.0f} s ago")


class Claim:
    """This process's hold on a staging directory while its save runs: the owner record,
    refreshed every ``heartbeat_s`` by a daemon thread, and an exclusive `flock` on the
    directory, released (and the record removed) by `release`."""

    def __init__(self, staging_dir: str, owner: Owner, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.staging_dir, self.owner = staging_dir, owner
        self.record = os.path.join(staging_dir, OWNER_FILE)
        self._stop = threading.Event()
        self._fd = os.open(staging_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
            fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(owner), f)
        except BaseException:
            self._close()
            raise
        _held[owner.save_id] = self
        # The thread holds the claim weakly: a failed save that drops its claim unreleased stops it.
        self._thread = threading.Thread(target=_beat, args=(weakref.ref(self), self._stop, self.record, heartbeat_s),
                                        daemon=True, name=f"safe_ckpt-heartbeat-{owner.save_id}")
        self._thread.start()

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def release(self, record_in: str | None = None) -> None:
        """Stop the heartbeat, remove the owner record (from ``record_in`` if the directory
        was renamed there) and drop the lock. Idempotent."""
        self.stop_heartbeat()
        try:
            os.unlink(os.path.join(record_in, OWNER_FILE) if record_in else self.record)
        except FileNotFoundError:
            pass
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:  # dropped unreleased: let the lock go; the record then reads as over
        if hasattr(self, "_fd"):
            self._stop.set()
            self._close()


def _beat(claim_ref, stop: threading.Event, record: str, heartbeat_s: float) -> None:
    failing = False
    while not stop.wait(heartbeat_s) and claim_ref() is not None:
        try:
            os.utime(record)
        except OSError as exc:
            # A passing fault (a stale NFS handle, a full quota) must not make the save look dead
            # for good; if the directory was taken away, the pre-publish check says so.
            if not failing:
                log.warning("cannot refresh %s (%s); retrying every %.0f s", record, exc, heartbeat_s)
            failing = True
            continue
        if failing:
            log.info("refreshed %s again", record)
        failing = False
