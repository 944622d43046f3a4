"""Bodies of the interrupted-publish tests (tests/targets/test_publish_interrupted_after_the_swap.py), run on every rank
of a gloo world.

Each scenario saves a checkpoint through the Megatron adapter (`save_state`: publish, then the
tracker), then saves again with a fault injected on rank 0 at one exact step of `commit.publish`:
the first fsync of the parent directory, which comes after the checkpoint was swapped or renamed
into place. The fault is a `KeyboardInterrupt` raised there, a real SIGINT delivered there, or EIO.
The parent process judges what is on disk; each rank reports how its save ended.
"""

from __future__ import annotations

import errno
import logging
import os
import signal

import torch

from safe_ckpt.targets.directory import publish as commit

ROWS, COLS, TENSORS = 64, 64, 3


def rows(seed: int, rank: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + i)
    return torch.randn(ROWS, COLS, generator=g)


def state(seed: int, rank: int, world: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for i in range(TENSORS):
        data = rows(seed, rank, i)
        out[f"w{i}"] = ShardedTensor(f"w{i}", data, data.dtype, tuple(data.shape), (ROWS * world, COLS),
                                     (ROWS * rank, 0), axis_fragmentations=None)
    return out


def matches(path: str, seed: int, world: int) -> bool:
    """Whether the checkpoint at ``path`` loads (stock DCP) bit-exact as save ``seed`` wrote it."""
    import torch.distributed.checkpoint as dcp

    from safe_ckpt_lab.synthetic import bits_equal

    out = {f"w{i}": torch.empty(ROWS * world, COLS) for i in range(TENSORS)}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException):  # no checkpoint there (a missing index, missing files)
        return False
    return all(bits_equal(out[f"w{i}"], torch.cat([rows(seed, r, i) for r in range(world)])) for i in range(TENSORS))


def options(**kw):
    import safe_ckpt

    return safe_ckpt.SaveOptions(**{"chunk_bytes": 8 * 1024, "io_threads": 2, "progress_interval_s": 0,
                                    "collective_timeout_s": 120, **kw})


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _fault_at_parent_fsync(parent: str, fault: str):
    """A stand-in for `commit.fsync_path` whose first fsync of ``parent`` (the first one after the
    swap or rename into place) is interrupted or fails; later calls pass through."""
    real = commit.fsync_path
    fired = []

    def fsync_path(path, directory=False):
        if not fired and directory and os.path.abspath(path) == parent:
            fired.append(path)
            if fault == "raise_interrupt":
                raise KeyboardInterrupt("injected after the publish's rename")
            if fault == "sigint":
                os.kill(os.getpid(), signal.SIGINT)  # acted on at the next bytecode unless held
            elif fault == "eio":
                raise OSError(errno.EIO, "injected EIO syncing the parent directory")
        return real(path, directory=directory)

    return fsync_path, fired


def _interrupt_at_first_move(final_dir: str):
    """A stand-in for `os.replace` whose first move of a staged file into ``final_dir`` completes and is then
    interrupted (the in-place publish's first step past the removal of the old index)."""
    real = os.replace
    fired = []

    def replace(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if not fired and os.path.dirname(os.path.abspath(dst)) == final_dir:
            fired.append(dst)
            raise KeyboardInterrupt("injected after the first file moved in")

    return replace, fired


def _outcome(fn) -> dict:
    try:
        fn()
        return {"type": "ok", "message": ""}
    except BaseException as exc:  # judged by the parent
        return {"type": type(exc).__name__, "message": str(exc)}


def scenario(rank: int, world: int, root: str, path: str, fault: str) -> dict:
    """``path``: "exchange" (re-save of an existing name: renameat2), "two_renames" (the same
    without renameat2), "rename" (a new name), "publish_into" (Megatron's in-place strategy path)."""
    from safe_ckpt.megatron import save_state

    os.makedirs(root, exist_ok=True)
    if path == "publish_into":
        return _publish_into(rank, world, root, fault)
    save_state(state(1, rank, world), root, iter_dir(root, 1), "1", options=options())
    save_state(state(3, rank, world), root, iter_dir(root, 2), "2", options=options())
    target = 3 if path == "rename" else 1  # a new name, or a re-save of iteration 1 (the run went back to it)
    torch.distributed.barrier()
    records = _Records()
    logging.getLogger("safe_ckpt").addHandler(records)
    saved_fsync, saved_exchange = commit.fsync_path, commit._exchange
    fired: list = []
    if rank == 0:
        commit.fsync_path, fired = _fault_at_parent_fsync(os.path.abspath(root), fault)
        if path == "two_renames":
            commit._exchange = lambda a, b: False
    try:
        out = _outcome(lambda: save_state(state(2, rank, world), root, iter_dir(root, target), str(target),
                                          options=options()))
    finally:
        commit.fsync_path, commit._exchange = saved_fsync, saved_exchange
        logging.getLogger("safe_ckpt").removeHandler(records)
    out.update(fired=bool(fired), target=target, log=records.lines)
    torch.distributed.barrier()
    return out


def _publish_into(rank: int, world: int, root: str, fault: str) -> dict:
    from safe_ckpt import saving

    target = iter_dir(root, 1)
    saving.save(state(1, rank, world), target, options=options())
    torch.distributed.barrier()
    saved_replace, fired = os.replace, []
    if rank == 0:
        os.replace, fired = _interrupt_at_first_move(os.path.abspath(target))
    try:
        out = _outcome(lambda: saving.start(state(2, rank, world), target, options=options(),
                                            sharded_only=True).finish())
    finally:
        os.replace = saved_replace
    out.update(fired=bool(fired), target=1, log=[])
    torch.distributed.barrier()
    return out


def all_scenarios(rank: int, world: int, root: str, cases: list) -> dict:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a run started in the background inherits it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return {f"{path}/{fault}": scenario(rank, world, os.path.join(root, f"{path}-{fault}"), path, fault)
            for path, fault in cases}
