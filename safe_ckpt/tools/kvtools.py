"""`verify` and `inspect` on a kvstore location (a `sinks.tensorstore.KvTarget`): the entry
points callers of the object-store tools knew, now `on_target` on the target it names.

One job: turn a location and a request timeout into a `Target` (`targets.resolve`) and follow
its tracker. Must not: know which kind of target it names (the registry does).
"""

from __future__ import annotations

from ..sinks.tensorstore import DEFAULT_REQUEST_TIMEOUT_S
from ..targets import Target, TargetSettings, resolve
from . import on_target


def _target(location, request_timeout_s: float) -> Target:
    return resolve(location.path, spec=location.spec, settings=TargetSettings(request_timeout_s=request_timeout_s))


def verify(location, *, deep: bool = False, progress=None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
    return on_target.verify(_target(location, request_timeout_s).follow_tracker(), deep=deep, progress=progress)


def inspect(location, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> dict:
    return on_target.inspect(_target(location, request_timeout_s).follow_tracker())
