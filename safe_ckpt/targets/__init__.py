"""A checkpoint's destination: claiming it, staging beside it, publishing atomically, aborting,
and the save root around it (tracker, retention, leftovers).

`base` (the `Target` interface and the types between its calls), `registry` (which target a
path names: `resolve`, `for_save`), `directory/` (a filesystem: a staging directory renamed
into place), `objectstore/` (a TensorStore kvstore: data keys tagged with the save,
`metadata.json` written last as the commit marker), `retention` (which older iterations to
remove), `endpoints` (where an `s3://` URL goes, as the environment says). Must not: know about
tensors or plans.
"""

from .base import (
    Followed, LayoutRules, LocalView, Prepared, PublishMode, Survey, Target, TargetSettings, WholeFiles, WriterSink,
)
from .registry import for_save, register, resolve

# Each implementation registers itself at its end; a new one is one more line here.
from .directory import target as _directory  # noqa: E402,F401
from .objectstore import target as _objectstore  # noqa: E402,F401

__all__ = ["Followed", "LayoutRules", "LocalView", "Prepared", "PublishMode", "Survey", "Target", "TargetSettings", "WholeFiles",
           "WriterSink", "for_save", "register", "resolve"]
