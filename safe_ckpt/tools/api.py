"""`safe_ckpt.verify` and `safe_ckpt.inspect`: the `safe-ckpt verify` / `inspect` commands as
Python calls.

One job: take what a user passes (a checkpoint directory, a save root whose tracker names
one, or an object-store URL) and hand it to the read-only tools in `tools/`, returning their
report. An `s3://` URL's endpoint is, unless given, `AWS_ENDPOINT_URL_S3`, else
`AWS_ENDPOINT_URL`, read here as the CLI reads it. Must not: check anything itself, print,
or modify the checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional

from ..sinks.tensorstore import DEFAULT_REQUEST_TIMEOUT_S
from .verify import VerifyReport


def _target(path: str, kvstore_spec: Optional[dict], endpoint: Optional[str], request_timeout_s: float):
    from ..sinks.tensorstore import resolve_target
    from ..targets import TargetSettings, resolve
    from ..targets.endpoints import endpoint_from, region_from

    location = resolve_target(os.fspath(path), kvstore_spec, endpoint or endpoint_from(os.environ),
                              region_from(os.environ))
    return resolve(location.path, spec=location.spec, settings=TargetSettings(request_timeout_s=request_timeout_s))


def verify(path: str, *, deep: bool = False, kvstore_spec: Optional[dict] = None, endpoint: Optional[str] = None,
           request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> VerifyReport:
    """Re-read every item of a torch_dist checkpoint and check it: files, sizes, archive
    structure, and checksums against safe_ckpt's manifest (``deep``: also load every tensor
    with ``torch.load(weights_only=True)``). A plain DCP checkpoint (no `metadata.json`, no
    manifest) is checked for all but checksums (``has_manifest`` False, ``plain_dcp`` True).
    Never runs code from the checkpoint.

    ``path``: a checkpoint directory, a save root holding `latest_checkpointed_iteration.txt`
    (the tracker is followed), or an object-store URL (``s3://bucket/prefix``, ``gs://``,
    ``file://``; or a path inside ``kvstore_spec``, a TensorStore kvstore spec).
    Returns a report: ``ok``, ``findings`` (severity, path, message), ``items_checked``,
    ``bytes_checked``, ``checksummed_items``. A path that is not a directory, or a tracker naming
    a missing checkpoint, or a save root without a tracker, raises ``ValueError``.
    """
    from . import on_target

    return on_target.verify(_target(path, kvstore_spec, endpoint, request_timeout_s).follow_tracker(), deep=deep)


def inspect(path: str, *, kvstore_spec: Optional[dict] = None, endpoint: Optional[str] = None,
            request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> dict:
    """What a torch_dist checkpoint holds, as `safe-ckpt inspect --json` prints it: ``tensors``
    (shape, dtype, chunks, stored bytes), ``objects``, ``files``, ``bytes_per_rank``,
    ``iteration``, ``distrib_optim_sharding_type``, and ``followed_tracker`` (the tracker's
    content when ``path`` was a save root). ``path`` as for `verify`. Never runs code from the
    checkpoint; an unreadable one raises `CheckpointError`.
    """
    from . import on_target

    return on_target.inspect(_target(path, kvstore_spec, endpoint, request_timeout_s).follow_tracker())
