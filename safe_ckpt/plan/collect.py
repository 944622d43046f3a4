"""Turn one rank's Megatron sharded state dict into local shard records and sources.

One job: walk the caller's state (factories applied, non-persistent objects dropped,
common state split off, exactly as megatron-core's save preprocessing does), check
every leaf for problems that can be seen locally, and record each tensor shard with
its source tensor, with its path in the caller's dict (``state['a'][0]``) for messages.
Problems are collected, never raised here, so every rank reaches the plan exchange and
fails together. Large plain tensors headed for the common state get one warning.
A later save of the same layout reuses each shard's checked draft where every fact the draft
reads is unchanged (`DraftMemo`); its source is always taken from the shard it is given.

Must not: touch CUDA, copy tensor data, or write files.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .. import compat
from .. import weights_only
from ..names import COMMON_STATE_FILE, COMMON_STATE_KEY
from ..errors import CheckpointError, UnloadableStateError, ValidationError
from .records import Box, ObjectRef, Problem

_V = ValidationError
log = logging.getLogger("safe_ckpt")
# Plain tensors above this go into the common state with a warning: Megatron pickles them
# whole on rank 0, so a model or optimizer tensor passed outside ShardedTensor is a mistake.
COMMON_TENSOR_WARN_BYTES = 1 << 20
_LISTED = 10


@dataclass(frozen=True)
class DraftShard:
    """A tensor shard before its residence is known."""

    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    box: Box
    is_main: bool
    path: str
    source: torch.Tensor  # viewed to the box's shape (prepended axes included)


@dataclass(frozen=True)
class LocalState:
    rank: int
    shards: list[DraftShard]
    objects: list[ObjectRef]
    object_payloads: dict[str, bytes]
    problems: list[Problem]
    common_state: dict = field(default_factory=dict)
    whole_files: dict[str, bytes] = field(default_factory=dict)  # rank 0: common.pt where used


ROOT = "state"  # how messages spell the caller's state dict: state['model']['layer'][0]


def _walk(tree: Any, path: str = ROOT, into_tuples: bool = False) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk(v, f"{path}[{k!r}]", into_tuples)
    elif isinstance(tree, list) or (into_tuples and isinstance(tree, tuple)):
        for i, v in enumerate(tree):
            yield from _walk(v, f"{path}[{i}]", into_tuples)
    else:
        yield path, tree


def _problem(key: str, rank: int, message: str, kind: type = _V) -> Problem:
    return Problem(kind=kind, key=key, ranks=(rank,), message=message)


def _tensor_problem(sh, rank: int) -> str | None:
    data = sh.data
    if data is None:
        return "data is None"
    if not isinstance(data, torch.Tensor):
        return f"data is a {type(data).__name__}, not a torch.Tensor"
    if type(data) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(data).__name__} is not supported; pass a plain tensor"
    if data.layout != torch.strided:
        return f"layout {data.layout} is not supported (only strided tensors)"
    if getattr(sh, "flattened_range", None) is not None:
        return "flattened_range shards are not supported; save with the dp_reshardable optimizer format"
    if data.dtype != sh.dtype:
        return f"data dtype {data.dtype} differs from the declared dtype {sh.dtype}"
    if not compat.is_saveable_dtype(sh.dtype):
        return f"dtype {sh.dtype} cannot be stored in a torch_dist checkpoint"
    if tuple(data.shape) != tuple(sh.local_shape):
        return f"data shape {tuple(data.shape)} is not local_shape {tuple(sh.local_shape)}"
    ndim = len(sh.global_shape)
    if len(sh.global_offset) != ndim or len(sh.local_shape) + sh.prepend_axis_num != ndim:
        return (
            f"rank mismatch: global_shape {tuple(sh.global_shape)}, global_offset {tuple(sh.global_offset)}, "
            f"local_shape {tuple(sh.local_shape)} with prepend_axis_num={sh.prepend_axis_num}"
        )
    return None


def _draft(sh, path: str, rank: int, is_main_replica=compat.is_main_replica) -> DraftShard | Problem:
    message = _tensor_problem(sh, rank)
    if message is not None:
        return _problem(sh.key, rank, f"{message} (at {path})")
    sizes = tuple(map(int, sh.local_shape))
    if sh.prepend_axis_num:
        sizes = (1,) * sh.prepend_axis_num + sizes
    box = Box(tuple(map(int, sh.global_offset)), sizes)
    return DraftShard(sh.key, sh.dtype, tuple(map(int, sh.global_shape)), box, is_main_replica(sh.replica_id), path,
                      _box_view(sh.data.detach(), sizes))


def _facts(sh, path: str) -> tuple:
    """Everything `_draft` reads of a shard but its data's bytes and storage (the source is taken
    anew every save): equal facts give an equal draft, problems included."""
    data = sh.data
    if not isinstance(data, torch.Tensor):
        return (path, sh.key, type(data))
    # Copied where mutable: a list the caller changes in place must not change the remembered facts.
    return (path, sh.key, sh.dtype, _frozen(sh.local_shape), _frozen(sh.global_shape), _frozen(sh.global_offset),
            sh.prepend_axis_num, _frozen(sh.replica_id), getattr(sh, "flattened_range", None), type(data), data.dtype,
            data.shape, data.layout)


def _frozen(value):
    if type(value) in (tuple, int):
        return value
    if isinstance(value, (list, tuple)):  # a torch.Size too (ShardedTensor.narrow makes one)
        return tuple(value)
    return object()  # anything else: never equal, drafted anew


class DraftMemo:
    """The previous save's drafts by position among its shards, with the facts they were drafted
    from: a training loop saves the same layout every time, and checking and boxing each of a
    thousand shards anew is most of `collect`. A shard whose facts differ in any field is drafted
    (and checked) again; only drafts without a problem are remembered, and never their source
    (a tensor the caller frees must not stay alive here). One per process (`draft_memo`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, tuple] = {}  # position -> (facts, key, dtype, global_shape, box, is_main)

    def drafts(self):
        """A drafting function for one save, and the call that keeps its drafts once it is done."""
        with self._lock:
            last = dict(self._last)  # this save's view: another save's `done` may replace the entries
        kept: dict[int, tuple] = {}

        def draft(k: int, sh, path: str, rank: int, is_main_replica) -> DraftShard | Problem:
            facts = _facts(sh, path)
            known = last.get(k)
            if known is not None and known[0] == facts:
                kept[k] = known
                _, key, dtype, global_shape, box, is_main = known
                return DraftShard(key, dtype, global_shape, box, is_main, path, _box_view(sh.data.detach(), box.sizes))
            out = _draft(sh, path, rank, is_main_replica)
            if not isinstance(out, Problem):
                kept[k] = (facts, out.key, out.dtype, out.global_shape, out.box, out.is_main)
            return out

        def done() -> None:
            with self._lock:  # in place: the dict itself may be in a gc.freeze()'d generation, and stays
                self._last.clear()
                self._last.update(kept)

        return draft, done

    def clear(self) -> None:
        with self._lock:
            self._last.clear()


draft_memo = DraftMemo()


def _box_view(data: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    # Prepended axes are size-1 axes in front; unsqueeze keeps strides valid for any layout.
    view = data
    for _ in range(len(sizes) - data.dim()):
        view = view.unsqueeze(0)
    return view


def _unloadable(key: str, rank: int, what: str, payload: bytes, safe_globals, tree=None,
                root: str = ROOT) -> Problem | None:
    """A problem where the loaders would refuse ``payload``: its pickle's globals checked against
    the allow-list they use (read, not run), so nothing is saved that cannot be read back. ``tree``: the
    state ``payload`` encodes, searched (on refusal only) for the entries that hold the class."""
    refusal = weights_only.unloadable(payload, safe_globals)
    if refusal is None:
        return None
    held = f"holds {refusal.refused_global}" if refusal.refused_global else f"cannot be rebuilt ({refusal.reason})"
    where = _refused_entries(tree, root, safe_globals) if tree is not None else ""
    where = f" (at {where})" if where else ""
    return _problem(key, rank, (
        f"{what} {held}{where}, which the loaders refuse: the common state and ShardedObjects are read with "
        f"torch.load(weights_only=True), admitting only torch's types, megatron-core's safe globals and "
        f"classes registered with torch.serialization.add_safe_globals; nothing was written. Convert it to "
        f"builtin types (dict, list, str, int, float) or tensors, or register the class with "
        f"torch.serialization.add_safe_globals([...]) in the saving process and in every loading process "
        f"(or pass it in SaveOptions.safe_globals here and LoadOptions.safe_globals where it is loaded)"),
        kind=UnloadableStateError)


def _refused_entries(tree, root: str, safe_globals) -> str:
    """The paths of ``tree``'s entries the loaders refuse on their own, with their types (a few)."""
    found = []
    for path, leaf in _walk(tree, root, into_tuples=True):
        try:
            refused = weights_only.unloadable(compat.torch_save_bytes(leaf), safe_globals) is not None
        except Exception:  # an entry that does not pickle alone is not the one to name
            refused = False
        if refused:
            found.append(f"{path}: a {type(leaf).__qualname__}")
    more = f" and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
    return ", ".join(found[:_LISTED]) + more


def _object(sh, path: str, rank: int, payloads: dict[str, bytes], main_paths: dict[str, str],
            safe_globals=()) -> ObjectRef | Problem:
    fqn = sh.unique_key
    is_main = compat.is_main_replica(sh.replica_id)
    payload_bytes = 0
    if is_main:
        if fqn in main_paths:
            return _problem(sh.key, rank, f"rank {rank} gives ShardedObject {fqn!r} twice as a main replica: "
                                          f"at {main_paths[fqn]} and {path}")
        main_paths[fqn] = path
        try:
            payloads[fqn] = compat.sharded_object_payload([sh.data])
        except Exception as exc:  # any pickling failure is the caller's data problem
            return _problem(sh.key, rank, f"ShardedObject {fqn!r} at {path} cannot be serialized: "
                                          f"{type(exc).__name__}: {exc}")
        refused = _unloadable(sh.key, rank, f"ShardedObject {fqn!r}", payloads[fqn], safe_globals, sh.data,
                              f"{path}.data")
        if refused is not None:
            return refused
        payload_bytes = len(payloads[fqn])
    return ObjectRef(
        fqn=fqn,
        key=sh.key,
        rank=rank,
        global_shape=tuple(sh.global_shape),
        offsets=tuple(sh.global_offset),
        is_main=is_main,
        payload_bytes=payload_bytes,
        path=path,
    )


def _large_common_tensors(common_state: dict) -> list[tuple[str, int]]:
    """(path, bytes) of each plain tensor in the common state whose pickled storage exceeds the threshold."""
    found = []
    for path, leaf in _walk(common_state, into_tuples=True):
        if isinstance(leaf, torch.Tensor):
            try:  # torch.save writes a view's whole storage, so that is what the common state grows by
                stored_bytes = leaf.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):  # storage-less tensors: count the elements
                stored_bytes = leaf.numel() * leaf.element_size()
            if stored_bytes > COMMON_TENSOR_WARN_BYTES:
                found.append((path, stored_bytes))
    return found


def _warn_large_common_tensors(common_state: dict) -> None:
    """One warning naming every large plain tensor headed for the (unsharded, rank 0) common state."""
    found = _large_common_tensors(common_state)
    if not found:
        return
    shown = ", ".join(f"{path} ({_mib(n)})" for path, n in found[:_LISTED])
    more = f" and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
    log.warning(
        "%d plain tensor(s) larger than %s are outside any ShardedTensor, so they go into the "
        "common state that rank 0 pickles whole (%s in all; other ranks' values are not saved): %s%s. "
        "Wrap them in a ShardedTensor to save them sharded.",
        len(found), _mib(COMMON_TENSOR_WARN_BYTES), _mib(sum(n for _, n in found)), shown, more)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def collect(sharded_state_dict: dict, rank: int, content_metadata: dict | None = None,
            with_common: bool = True, safe_globals=()) -> LocalState:
    """One rank's shards, objects, local problems and (on rank 0, ``with_common``) the common state.
    ``safe_globals``: classes beyond the loaders' own that its pickled parts may hold."""
    problems: list[Problem] = []
    try:
        mapping = compat.mcore_mapping()
    except ImportError as exc:  # megatron-core missing or older than the supported floor
        problems.append(_problem("<megatron-core>", rank, str(exc), kind=CheckpointError))
        return LocalState(rank, [], [], {}, problems)
    if not isinstance(sharded_state_dict, dict):
        problems.append(_problem("<root>", rank, f"state dict is a {type(sharded_state_dict).__name__}, not a dict"))
        return LocalState(rank, [], [], {}, problems)
    try:
        parts = compat.split_megatron_state(sharded_state_dict, content_metadata)
    except Exception as exc:  # a factory's build_fn failing is the caller's problem, on this rank
        problems.append(_problem("<factories>", rank, f"preprocessing failed: {type(exc).__name__}: {exc}"))
        return LocalState(rank, [], [], {}, problems)

    shards: list[DraftShard] = []
    objects: list[ObjectRef] = []
    payloads: dict[str, bytes] = {}
    main_object_paths: dict[str, str] = {}
    is_main_replica = mapping.is_main_replica  # once: `compat.is_main_replica` checks the version per call
    draft, drafted = draft_memo.drafts()
    tensors = 0
    for path, leaf in _walk(parts.sharded_tree):
        if isinstance(leaf, mapping.ShardedTensor):
            out = draft(tensors, leaf, path, rank, is_main_replica)
            tensors += 1
            (problems if isinstance(out, Problem) else shards).append(out)
        elif isinstance(leaf, mapping.ShardedObject):
            out = _object(leaf, path, rank, payloads, main_object_paths, safe_globals)
            (problems if isinstance(out, Problem) else objects).append(out)
        else:
            key = getattr(leaf, "key", path)
            problems.append(_problem(key, rank, f"{type(leaf).__name__} at {path} is not supported here"))

    drafted()
    common = parts.common_state if rank == 0 else {}
    whole_files: dict[str, bytes] = {}
    if rank == 0 and with_common:
        _warn_large_common_tensors(common)
        try:
            if compat.common_state_as_sharded_object():
                fqn = f"{COMMON_STATE_KEY}/shard_0_1"
                payload = payloads[fqn] = compat.common_state_payload(common)
                objects.append(
                    ObjectRef(fqn, COMMON_STATE_KEY, 0, (1,), (0,), True, len(payloads[fqn]), "<common>")
                )
            else:
                payload = whole_files[COMMON_STATE_FILE] = compat.torch_save_bytes(common)
        except Exception as exc:
            problems.append(_problem("<common state>", rank, f"cannot be serialized: {type(exc).__name__}: {exc}"))
        else:
            refused = _unloadable("<common state>", rank, "the common state", payload, safe_globals, common)
            if refused is not None:
                problems.append(refused)
    return LocalState(rank, shards, objects, payloads, problems, common, whole_files)
