"""A checkpoint's destination: claiming it, staging beside it, publishing atomically, aborting,
and the save root around it (tracker, retention, leftovers).

`directory/` (a filesystem: a staging directory renamed into place), `objectstore/` (a
TensorStore kvstore: data keys tagged with the save, `metadata.json` written last as the commit
marker), `retention` (which older iterations to remove), `endpoints` (where an `s3://` URL
goes, as the environment says). Must not: know about tensors or plans.
"""
