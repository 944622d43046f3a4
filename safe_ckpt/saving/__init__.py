"""`save` and `async_save`: the collective entry points.

Call order on every rank (each step after a collective sees the same data everywhere):
  1. plan: collect shards and objects, classify residences, rank 0 creates the
     staging directory; exchange the rank plans; agree on the global plan (`agreement`:
     the same verdict everywhere; a refused plan takes one more exchange to word its errors);
  2. write: stage and write this rank's items into the staging directory, fsync;
  3. vote: every rank reports success or its failure; any failure fails all ranks;
  4. commit: rank 0 writes `.metadata` and `metadata.json`, publishes atomically;
  5. vote: every rank learns whether the checkpoint is visible;
  6. with a ``post_commit`` step (the tracker file): that step, then a last vote.
`async_save` returns after step 2's staging of device memory; a background thread
runs the rest. With `SaveOptions.return_after="planned"` it returns right after step 1 and the
device-to-host copies run while the caller goes on (see `async_save`).

Failures: whatever a rank meets between two collectives (an exception in its planning,
a sink factory that raises, a writer's error, an exception in ``post_commit``) goes to
the next collective, always a vote (`ballot`): every rank raises the same
`CheckpointError` once all have reached it, rank 0 removes the staging directory, and
the group stays in step. A `KeyboardInterrupt` or `SystemExit` is handled the same way
(writers cancelled and joined, nothing published) and re-raised as itself on its rank.
Once the checkpoint is in place (the target's publish swapped or renamed it) the save finishes:
an interrupt arriving from then on (a SIGINT is held through the publish and the
``post_commit`` step) is re-raised on its rank only after the checkpoint is durable and the
tracker written, with a log line saying so; the other ranks succeed.

Concurrency: one save runs at a time per process (`slot`), sync and async alike, from
any thread: a later save waits for the earlier one to end (its handle to finish), at
most `SaveOptions.collective_timeout_s`, then fails on that rank with a
`CoordinationError`. Every collective carries the save's name and step (`dist`), so
ranks that start saves in different orders (each process taking them one at a time)
fail those saves on every rank with a `CoordinationError` naming both saves, and
publish nothing of them; saves started in the same order on every rank all succeed.

The state of one save on one rank is `job.SaveJob` (its phases: `job.Planned`, `job.Writing`,
then the `SaveResult`); this rank's planning message is built in `local_plan`; rank 0's commit
in `committing`; `handle` finishes an asynchronous save. The destination is a
`targets.Target` (`targets.for_save`): nothing here knows which kind. Must not: contain stage logic (that
lives in plan/, residence/, staging/, encoding/, write/, sinks/, targets/).
"""

from __future__ import annotations

import logging

from ..coord import slot
from ..host import gcfreeze
from ..options import SaveOptions, checked as checked_save_options
from ..results import SaveResult
from ..staging import gates
from .. import targets
from ..targets import PublishMode, endpoints
from .handle import SaveHandle
from .job import SaveJob

log = logging.getLogger("safe_ckpt")

__all__ = ["SaveHandle", "SaveJob", "async_save", "save", "start"]


def start(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
          content_metadata: dict | None = None, sharded_only: bool = False, post_commit=None,
          asynchronous: bool = False, copy_start: str = "now") -> SaveJob:
    """Plan and start writing (collective); for the adapters at the edges. The returned job
    is finished with `.finish()`, or (``asynchronous``) with `.in_background()`, which returns
    the `SaveHandle`. ``sharded_only``: Megatron's own save owns the directory, its common
    state and metadata.json; this save adds the sharded items and `.metadata` into it. Waits
    for this process's previous save to end first (see above). ``copy_start``: for an
    asynchronous save with ``return_after="planned"``, "now" opens its copy window in this call,
    "deferred" at the next `staging.gates.open_deferred()` or gate (the Megatron drop-in: the next
    `optimizer.zero_grad()`, since Megatron synchronizes the device right after its save call)."""
    # An `s3://` URL goes where the environment's AWS_ENDPOINT_URL_S3 says, as on the command line.
    checkpoint_dir, options = endpoints.save_target(checkpoint_dir, checked_save_options(options))
    mode = PublishMode.INTO_EXISTING if sharded_only else PublishMode.WHOLE
    job = SaveJob(sharded_state_dict, targets.for_save(checkpoint_dir, options), process_group, options,
                  content_metadata, mode=mode, post_commit=post_commit, asynchronous=asynchronous,
                  copy_start=copy_start)
    if not asynchronous and options.return_after == "planned":
        log.info("return_after='planned' applies to asynchronous saves only: the save to %s returns once published",
                 checkpoint_dir)
    gates.open_deferred()  # an earlier save's window waiting for its trigger would hold the slot until it times out
    job.slot = slot.acquire(job.checkpoint_dir, options.collective_timeout_s)
    try:
        job.gc_hold = gcfreeze.Hold(options.gc_freeze)
        job.plan()
    except BaseException as exc:
        if job.awaits_vote:  # the peers wait in the writing vote: tell them, then raise
            job.note("writing", exc)
            job.finish()
        job.release()
        raise
    return job


def save(sharded_state_dict: dict, checkpoint_dir, options: SaveOptions | None = None, *, process_group=None,
         content_metadata: dict | None = None) -> SaveResult:
    """Save a Megatron sharded state dict in the torch_dist layout. Collective.

    Every rank of ``process_group`` (default: all ranks, over a cached gloo group)
    calls it with its own shards. Returns once the checkpoint is published, or raises
    the same `CheckpointError` on every rank and leaves nothing a loader would take
    for a checkpoint (a rank interrupted by `KeyboardInterrupt` or `SystemExit` raises
    that instead, once its writers have stopped and its peers were told).
    """
    return start(sharded_state_dict, checkpoint_dir, process_group=process_group, options=options,
                 content_metadata=content_metadata).finish()


def async_save(sharded_state_dict: dict, checkpoint_dir, options: SaveOptions | None = None, *, process_group=None,
               content_metadata: dict | None = None) -> SaveHandle:
    """Like `save`, but returns once every device-resident byte is staged in host memory.

    With a staging budget smaller than the device bytes, staging waits for earlier
    chunks to be written, so the return is later. Host tensors are written from their
    own memory afterwards. Until they are, every torch optimizer step in the process waits in
    a step pre-hook (as does `safe_ckpt.before_update()`, for loops that change
    host tensors outside an optimizer step), so the next step never mixes into the checkpoint,
    even one that moves no version counter (a fused CPU AdamW, as `--optimizer-cpu-offload`
    runs); past `collective_timeout_s` the save is abandoned (`StagingTimeoutError`) and the
    step goes on. Other writes to host tensors must wait for the handle. What is detected (the save then fails with `SourceModifiedError` naming the key and
    rank, and publishes nothing):
    - an in-place operation on the saved tensor object itself (``w.add_(1)``), at any
      time before its last chunk is written (the tensor's version counter moved);
    - any change to a contiguous chunk's bytes, by whatever means (``w.data.fill_()``,
      a numpy view, another process through shared memory), made while that chunk is
      being written: its bytes are hashed before the write and again after it.
    Not detected: a change through ``.data`` or a view that does not share the version
    counter, made wholly before a chunk's write begins or after it ends (the checkpoint
    then holds, for that tensor, a mix of values from before and after the change), and
    changes to the few non-contiguous host chunks that are copied to the staging pool
    before their write. Device-resident tensors are copied before `async_save` returns
    and may change freely afterwards.

    With ``options.return_after="planned"`` it returns right after planning (the handle's
    `stall_s` is the call's time). Every source (device and host) then goes through a copy
    window: device bytes are copied into the pinned pool on a side stream and host tensors
    snapshotted into it while the caller goes on; every torch optimizer step, `before_update()`
    (also `SaveHandle.before_update()`) and torch_memory_saver's `pause` wait for what is still
    uncopied (a stream wait once every copy is issued; the host blocks only while the pool is
    too small or host snapshots run). A write none of these orders (through ``.data``, from
    another stream, in place) is found by the sources' version counters or their content sums
    (taken at the window's opening and after each source's last copy) and fails the save with
    `SourceModifiedError`: nothing is published. Once the window closed
    (`SaveHandle.window_closed()`) the sources may change freely.
    """
    return start(sharded_state_dict, checkpoint_dir, process_group=process_group, options=options,
                 content_metadata=content_metadata, asynchronous=True).in_background()
