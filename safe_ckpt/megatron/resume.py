"""Which checkpoint this process resumed from, so that retention never removes it.

One job: remember the checkpoint directories this process loaded, and answer which
iterations of a save root retention must keep for that reason. A load path that knows
what it read says so (`note_loaded`); otherwise the Megatron adapter works it out from
Megatron's arguments at the first save, exactly as Megatron's `load_checkpoint` picks its
directory (`loaded_from_args`):

- the load directory is `--load`; where it has no tracker file and `--pretrained-checkpoint`
  is set, that one instead (Megatron then turns `--finetune` on);
- the iteration is `--ckpt-step` where given (non-zero), else the one the load directory's
  tracker names (`release` for a release checkpoint); no tracker and no `--ckpt-step`: nothing
  was loaded;
- `--finetune` loads that same directory (it resets the iteration counter only), and
  `--no-load-optim` / `--no-load-rng` only leave parts of it unread: neither changes which
  directory it was.

A loaded checkpoint is kept only where it lives in the save root (the same directory after
resolving symbolic links; for object stores the same prefix of the same store). A process
that never said what it loaded, and never saved through the Megatron adapter, falls back to
the iteration the save root's tracker named before its first save there.

Must not: remove or read checkpoints (tracker files only), or decide a retention policy.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from .. import targets
from ..names import ITERATION_DIR, RELEASE_DIR, TRACKER_FILE, iteration_dir
from ..targets import Target

log = logging.getLogger("safe_ckpt")


@dataclass(frozen=True)
class LoadedCheckpoint:
    root: str  # `Target.place_key` of the save root holding it
    name: str  # "iter_0000100" or "release"
    iteration: int | None  # None for a release checkpoint
    path: str  # as the caller named it, for log lines


class _Registry:
    """What this process noted; one per process (`_registry`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded: list[LoadedCheckpoint] = []
        self.told = False  # something (possibly "nothing was loaded") was noted
        self.tracker_fallback: dict = {}  # place key -> the iteration its tracker named at the first save


_registry = _Registry()


def _as_target(root: "Target | str", spec: dict | None = None) -> Target:
    if isinstance(root, Target):
        return root
    if spec is None and root.startswith("s3://"):
        # the save's endpoint rule (AWS_ENDPOINT_URL...), so a URL names the place a save there uses
        from ..options import SaveOptions
        from ..targets import endpoints

        root, options = endpoints.save_target(root, SaveOptions())
        spec = options.kvstore_spec
    return targets.resolve(root, spec=spec)


def checkpoint_name(iteration: int | None, release: bool = False) -> str:
    """Megatron's directory name for an iteration (`get_checkpoint_name(..., return_base_dir=True)`)."""
    return RELEASE_DIR if release else iteration_dir(iteration)


def note_loaded(checkpoint_dir: str | None, *, kvstore_spec: dict | None = None) -> None:
    """Record that this process loaded the checkpoint at ``checkpoint_dir`` (an `iter_XXXXXXX`
    or `release` directory; a path inside ``kvstore_spec`` where given). None records that
    nothing was loaded (a fresh start), which also turns the tracker fallback off.
    Call it after every load of training state; retention keeps each of them that lives in
    the save root for the rest of the process."""
    with _registry.lock:
        _registry.told = True
        if checkpoint_dir is None:
            return
        path = os.fspath(checkpoint_dir).rstrip("/")
        parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
        m = ITERATION_DIR.match(name)
        if m is None and name != RELEASE_DIR:
            log.warning("%s is not an iteration directory (iter_XXXXXXX or release); retention "
                        "cannot tell which iteration it is and protects nothing for it", path)
            return
        # a local checkpoint with no parent lies in ".", one at a store's root in its root ("")
        root = parent if kvstore_spec is not None else (parent or ".")
        try:
            key = _as_target(root, None if kvstore_spec is None else dict(kvstore_spec)).place_key()
        except Exception as exc:  # a URL no save could use either: nothing of a save root to protect
            log.warning("cannot tell which place %s names (%s); retention protects nothing for it", path, exc)
            return
        loaded = LoadedCheckpoint(key, name, int(m.group(1)) if m else None, path)
        if loaded not in _registry.loaded:
            _registry.loaded.append(loaded)
            log.info("this run resumed from %s; retention keeps it", path)


def noted() -> bool:
    with _registry.lock:
        return _registry.told


def loaded_from_args(args, read_tracker=None) -> str | None:
    """The checkpoint directory Megatron's `load_checkpoint` reads with these arguments, or None
    where it loads nothing. ``read_tracker(load_dir)`` returns the tracker's text ("" if there is
    none); the default reads it through the target the path names."""
    read_tracker = read_tracker or (lambda d: tracker_text(targets.resolve(d)))
    load_dir = getattr(args, "load", None)
    tracker = read_tracker(load_dir) if load_dir else ""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if not tracker and pretrained:  # Megatron: no checkpoint under --load, finetune from the pretrained one
        load_dir, tracker = pretrained, read_tracker(pretrained)
    if load_dir is None:
        return None
    iteration, release = None, False
    if tracker.isdigit():
        iteration = int(tracker)
    elif tracker == RELEASE_DIR:
        release = True
    elif tracker:
        log.warning("the tracker under %s holds %r, not an iteration; retention cannot tell which "
                    "checkpoint this run loaded", load_dir, tracker[:40])
    if getattr(args, "ckpt_step", None):  # as Megatron: 0 means "not given", and a release tracker wins
        iteration = int(args.ckpt_step)
    if iteration is None and not release:
        return None
    return load_dir.rstrip("/") + "/" + checkpoint_name(iteration, release)


def protected(save_root: "Target | str") -> frozenset:
    """The iterations retention keeps in ``save_root`` (a `Target`, or a path or URL naming one)
    because this run resumed from them: the loaded checkpoints that live there, or, where this
    process never said what it loaded, the iteration the root's tracker named before this
    process first saved there."""
    root = _as_target(save_root)
    key = root.place_key()
    with _registry.lock:
        if _registry.told:
            return frozenset(c.iteration for c in _registry.loaded if c.root == key and c.iteration is not None)
        if key not in _registry.tracker_fallback:
            text = tracker_text(root)
            _registry.tracker_fallback[key] = int(text) if text.isdigit() else None
        value = _registry.tracker_fallback[key]
    return frozenset() if value is None else frozenset({value})


def forget() -> None:
    """Drop everything noted (a process that starts another run in itself, and tests)."""
    with _registry.lock:
        _registry.loaded.clear()
        _registry.told = False
        _registry.tracker_fallback.clear()


def tracker_text(root: Target) -> str:
    """The text of the tracker (`TRACKER_FILE`) under the save root ``root``; "" where it has none
    or cannot be read (retention then keeps only what its policy keeps)."""
    try:
        return root.read_tracker() or ""
    except Exception as exc:
        log.warning("cannot read the tracker under %s (%s); retention cannot protect the "
                    "checkpoint this run resumed from", root.name, exc)
        return ""
