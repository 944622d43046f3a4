"""Read-only and housekeeping tools behind the command line and `safe_ckpt.verify` /
`safe_ckpt.inspect` (`api`): `verify`, `inspect`, `copy`, and `kvtools` (verify and inspect on an
object-store prefix). They read checkpoints through `encoding.safe_read` (never running code from
them) and find them through `targets` (a save root's tracker, an object store's prefix); `gc`
is each target's own (`targets.directory.gc`, `targets.objectstore.gc`).
Must not: write a checkpoint except through a target (`copy`).
"""
