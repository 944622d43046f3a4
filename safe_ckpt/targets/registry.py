"""Which `Target` a path or URL names: one registration per kind of destination.

One job: map a location to its target class and build it. A plain path is the class registered
with ``paths=True``; a URL picks the class registered for its scheme, else the one registered
with ``urls=True`` (as does any location inside a store spec). A new kind of target is one
module that subclasses `base.Target` and calls `register` at its end, plus one import line in
`targets/__init__.py` (docs/extending.md). Must not: open or touch the location.
"""

from __future__ import annotations

import os

from .base import Target, TargetSettings

_by_scheme: dict[str, type[Target]] = {}
_for: dict[str, type[Target]] = {}  # "paths": no scheme; "urls": any other URL, or a spec


def register(cls: type[Target], *, schemes=(), paths: bool = False, urls: bool = False) -> type[Target]:
    for scheme in schemes:
        _by_scheme[scheme] = cls
    if paths:
        _for["paths"] = cls
    if urls:
        _for["urls"] = cls
    return cls


def scheme_of(path) -> str | None:
    """``"s3"`` for ``"s3://b/p"``; None for a plain path."""
    return path.split("://", 1)[0] if isinstance(path, str) and "://" in path else None


def target_class(path, spec: dict | None = None) -> type[Target]:
    scheme = scheme_of(path)
    if spec is None and scheme is None:
        return _for["paths"]
    return _by_scheme.get(scheme or "", _for["urls"]) if spec is None else _for["urls"]


def resolve(path, *, spec: dict | None = None, settings: TargetSettings = TargetSettings()) -> Target:
    """The target ``path`` names (inside the store ``spec`` where given). Touches nothing."""
    path = os.fspath(path)
    cls = target_class(path, spec)
    return cls(path, settings) if spec is None else cls(path, settings, spec=spec)


def for_save(checkpoint_dir, options) -> Target:
    """The target of one save, with the save's `SaveOptions` settings."""
    return resolve(checkpoint_dir, spec=options.kvstore_spec, settings=TargetSettings.of(options))
