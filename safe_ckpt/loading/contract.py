"""`safe_ckpt.load`: the contract of megatron-core's `dist_checkpointing.load`, read by safe_ckpt.

One job: run the steps stock `load` runs, with megatron-core's own helpers, in its order:
read the common state; apply factories (`load_preprocess`); merge the LocalNonpersistentObjects;
keep the ShardedBase leaves; check sharding integrity and strictness against the checkpoint
(`validate_integrity_and_strict_load`); load the sharded part; merge it into the common state;
apply the factories' merges; return what stock returns for the ``strict`` given. What differs
is how, not what: the checkpoint's files are read through `source` / `kvsource` (a directory,
or a TensorStore kvstore / `s3://` prefix), `.metadata` through the restricted reader, the
common state and ShardedObjects with `weights_only=True`, the ranks' metadata exchanged over a
CPU (gloo) group instead of the default group, and every rank fails together: stock checks
sharding integrity on rank 0 only and lets the others go on.
Must not: read tensor bytes itself (`sharded` does), or use NCCL.
"""

from __future__ import annotations

import os

import torch

from ..coord import dist
from ..host import gcfreeze
from ..names import COMMON_STATE_FILE, METADATA_FILE
from ..targets import endpoints
from ..errors import ReadError, ValidationError, failure_from_exception
from ..sinks.tensorstore import KvTarget, is_kvstore_url
from . import index as index_mod
from . import megatron_integrity, objects
from .kvsource import KvSource
from .options import LoadOptions, checked as checked_load_options
from .sharded import read_sharded, vote
from .source import DirectorySource



def _options(options) -> LoadOptions:
    return checked_load_options(options)


def open_source(checkpoint_dir, options: LoadOptions):
    # an s3:// URL goes where a save of it goes (--endpoint aside: AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL)
    path, options = endpoints.save_target(os.fspath(checkpoint_dir), options)
    if options.kvstore_spec is not None or is_kvstore_url(path):
        return KvSource(KvTarget(path, options.kvstore_spec), options.kvstore_request_timeout_s)
    return DirectorySource(path)


def read_common_state_dict(checkpoint_dir, options: LoadOptions | None = None) -> dict:
    """The common state alone, as stock `load_common_state_dict` returns it (one rank, no peers).
    `.metadata` is read only where the common state is stored in it (no `common.pt`): Megatron's
    `load_checkpoint` calls this just before `load`, which reads the index anyway."""
    options = _options(options)
    source = open_source(checkpoint_dir, options)
    try:
        index_mod.read_config(source)
        if not source.exists(METADATA_FILE):  # the index is written last: without it the save did not finish
            raise ReadError(f"{source.describe(METADATA_FILE)}: missing: not a torch_dist checkpoint, or one "
                            "whose save did not finish")
        index = None if source.exists(COMMON_STATE_FILE) else index_mod.read_index(source, checksums=False)
        return objects.read_common_state(source, index, options.safe_globals)
    finally:
        source.close()


def read_sharded_metadata(checkpoint_dir, options: LoadOptions | None = None) -> dict:
    """What stock `load_sharded_metadata` returns (one rank, no peers)."""
    source = open_source(checkpoint_dir, _options(options))
    try:
        return index_mod.sharded_metadata(index_mod.read_index(source, checksums=False), with_common_state=True)
    finally:
        source.close()


def load_sharded(tree, checkpoint_dir, options: LoadOptions | None = None, process_group=None):
    """The sharded part alone (ShardedTensor / ShardedObject leaves), as a load strategy's `load`
    returns it. Collective."""
    options = _options(options)
    where = os.fspath(checkpoint_dir)
    coord = dist.coordinator(process_group, options.collective_timeout_s, target=f"load {where}")
    source, index, failure = None, None, None
    try:
        source = open_source(checkpoint_dir, options)
        index = index_mod.read_index(source, checksums=options.verify_checksums)
    except Exception as exc:
        failure = failure_from_exception(coord.rank, "index", exc)
    try:
        vote(coord, "opening", where, failure)
        return read_sharded(tree, source, index, options, coord, where)
    finally:
        if source is not None:
            source.close()


def _as_validation(exc: BaseException) -> BaseException:
    """Megatron's CheckpointingException (a bad request, not bad bytes) as a ValidationError."""
    if type(exc).__name__ == "CheckpointingException":
        return ValidationError(str(exc))
    return exc


def load(sharded_state_dict: dict, checkpoint_dir, options: LoadOptions | None = None, *, strict=None,
         validate_access_integrity: bool = True, verify_integrity: bool = False, process_group=None):
    """Load a torch_dist checkpoint into ``sharded_state_dict``, as
    `megatron.core.dist_checkpointing.load(sharded_state_dict, checkpoint_dir, strict=...,
    validate_access_integrity=..., verify_integrity=...)` does. Collective over ``process_group``
    (a gloo group; None: the whole world, over a gloo group safe_ckpt creates).

    Tensors are filled in place where the ShardedTensor has data (on its device: GPU, pinned or
    pageable host); the result is the loaded state dict (with ``strict`` returning mismatch keys:
    ``(state_dict, missing_keys, unexpected_keys)``). Raises `CheckpointError` (`ReadError` for
    unreadable, truncated, corrupt or refused bytes, `ValidationError` for a state dict that does
    not match the checkpoint) on every rank when any rank fails.
    """
    options = _options(options)
    hold = gcfreeze.Hold(options.gc_freeze)
    try:
        return _load(sharded_state_dict, checkpoint_dir, options, strict, validate_access_integrity,
                     verify_integrity, process_group)
    finally:
        hold.release()


def _load(sharded_state_dict, checkpoint_dir, options, strict, validate_access_integrity, verify_integrity,
          process_group):
    from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base, force_all_tensors_to_non_fp8
    from megatron.core.dist_checkpointing.validation import (StrictHandling, parse_strict_flag,
                                                             validate_integrity_and_strict_load)

    where = os.fspath(checkpoint_dir)
    coord = dist.coordinator(process_group, options.collective_timeout_s, target=f"load {where}")
    source, index, common, failure = None, None, None, None
    try:
        source = open_source(checkpoint_dir, options)
        index = index_mod.read_index(source, checksums=options.verify_checksums)
        if verify_integrity and coord.rank == 0:
            problems = megatron_integrity.verify(source)
            if problems:
                raise ReadError(f"integrity verification failed for {len(problems)} file(s) in {where} "
                                          f"(integrity.json):\n  " + "\n  ".join(problems))
        common = objects.read_common_state(source, index, options.safe_globals)
    except Exception as exc:
        failure = failure_from_exception(coord.rank, "index", exc)
    try:
        vote(coord, "opening", where, failure)

        force_all_tensors_to_non_fp8(sharded_state_dict)
        sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
        merge(common, nonpersistent)
        sharded, _ = extract_sharded_base(sharded)

        strict = parse_strict_flag(StrictHandling.ASSUME_OK_UNEXPECTED if strict is None else strict)
        local = [sh.without_data() for sh in nested_values(sharded)]
        global_metadata = None
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            validate_access_integrity = False  # one process, no peers: megatron's check needs a process group
        if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
            global_metadata = coord.exchange("load: sharding", local)
        failure, missing, unexpected = None, set(), set()
        try:
            ckpt_metadata = index_mod.sharded_metadata(index) \
                if StrictHandling.requires_explicit_ckpt_mismatch_check(strict) else None
            sharded, missing, unexpected = validate_integrity_and_strict_load(
                sharded, strict, validate_access_integrity, local, global_metadata, ckpt_metadata)
        except Exception as exc:
            failure = failure_from_exception(coord.rank, "validation", _as_validation(exc))
        vote(coord, "validation", where, failure)

        loaded = read_sharded(sharded, source, index, options, coord, where)
        merge(common, loaded)
        apply_factory_merges(common, factories)
    finally:
        if source is not None:
            source.close()
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common
