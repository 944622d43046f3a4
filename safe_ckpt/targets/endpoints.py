"""Where an object-store target goes, as the environment says: one rule for every entry point.

One job: read the process environment (an edge: `safe_ckpt.save`/`async_save`, the command
line and the Megatron adapter all call `save_target` or `tool_target`, nothing else reads these
variables) and turn a target into the kvstore target TensorStore is given:
- the endpoint of an `s3://BUCKET/PREFIX` URL: the command line's ``--endpoint``, else
  `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL` (the order boto3 reads them in); with one, the
  URL becomes TensorStore's `s3` spec for that S3-compatible store (MinIO, Ceph RGW, moto) and
  the prefix inside it; the region from `AWS_REGION`, else `AWS_DEFAULT_REGION`, else us-east-1;
- with `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` set, every `s3` spec that names no
  `aws_credentials` takes them from the environment only; TensorStore's default chain would
  otherwise also look for `~/.aws/config` and `~/.aws/credentials` and log an `E...` line per
  missing file on every open.
Other targets (local paths, `gs://`, `file://`, `memory://` URLs, other specs) pass unchanged.
Must not: open a store or be called below the entry points.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from ..sinks.tensorstore import ENVIRONMENT_CREDENTIALS, KvTarget, resolve_target


def endpoint_from(environ: Mapping[str, str]) -> Optional[str]:
    """The S3 endpoint boto3 would use: `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`."""
    return environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None


def region_from(environ: Mapping[str, str]) -> Optional[str]:
    return environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or None


def credentials_from(environ: Mapping[str, str]) -> Optional[dict]:
    """TensorStore's `aws_credentials` spec for keys given in the environment (None: its default chain)."""
    if environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
        return dict(ENVIRONMENT_CREDENTIALS)
    return None


def tool_target(path: str, spec: Optional[dict] = None, endpoint: Optional[str] = None,
                environ: Optional[Mapping[str, str]] = None) -> KvTarget:
    """A tool's target: ``endpoint`` (a command-line flag) first, then the environment's."""
    environ = os.environ if environ is None else environ
    return resolve_target(path, spec, endpoint or endpoint_from(environ), region_from(environ),
                          credentials_from(environ))


def save_target(target, options, environ: Optional[Mapping[str, str]] = None) -> tuple:
    """A save's target and options: (path, options); for an `s3://` URL at an endpoint, the path
    inside the `s3` spec that is then ``options.kvstore_spec``. Idempotent."""
    target = os.fspath(target)
    if options.kvstore_spec is None and not (isinstance(target, str) and target.startswith("s3://")):
        return target, options  # a local path or another URL: nothing here concerns it
    resolved = tool_target(target, options.kvstore_spec, None, environ)
    if resolved.spec is not None and resolved.spec != options.kvstore_spec:
        options = dataclasses.replace(options, kvstore_spec=resolved.spec)
    return resolved.path, options


def save_state_targets(save_dir, checkpoint_dir, options, environ: Optional[Mapping[str, str]] = None) -> tuple:
    """A training save's root and checkpoint directory by the same rule: (save_dir, checkpoint_dir,
    options). Two `s3://` URLs become paths inside one `s3` spec; they must name the same bucket."""
    root, root_options = save_target(save_dir, options, environ)
    checkpoint, checkpoint_options = save_target(checkpoint_dir, options, environ)
    if root_options.kvstore_spec != checkpoint_options.kvstore_spec:
        from ..errors import ValidationError

        raise ValidationError(f"the save root {save_dir} and the checkpoint {checkpoint_dir} must lie in one store "
                              "(the same bucket and endpoint)")
    return root, checkpoint, checkpoint_options
