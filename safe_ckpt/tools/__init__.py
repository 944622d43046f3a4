"""Read-only and housekeeping tools behind the command line and `safe_ckpt.verify` /
`safe_ckpt.inspect` (`api`): `verify` and `inspect` of a local directory, `on_target` (both on
the checkpoint any `Target` holds), `kvtools` (the same, by a kvstore location), `copy`.
They read checkpoints through `encoding.safe_read` (never running code from them) and find
them through `targets.resolve` (a save root's tracker, a local view of the files); `gc` is
`Target.collect_leftovers`. Must not: write a checkpoint except through a target (`copy`), or
know which kind of target they are given.
"""
