"""Rank bodies of the hostile-checkpoint load tests: rank 0 damages a saved checkpoint one way,
then every rank loads it with `safe_ckpt.load`; each must raise the same error (see mp.py)."""

from __future__ import annotations

import fractions
import json
import os
import pickle
import shutil

import torch
import torch.distributed as dist

import safe_ckpt
from safe_ckpt.names import MANIFEST_FILE
from safe_ckpt_lab.synthetic import StateSpec, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL, compare_loaded, small_options
from tests.helpers.bodies.load import load_options
from tests.helpers.mp import describe_exception

CASES = ["truncated", "corrupt_payload", "corrupt_framing", "fifo", "symlink_out", "metadata_pickle",
         "common_pickle", "object_class", "missing_key", "shape_mismatch", "no_metadata_json", "integrity_json"]


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _largest_item(path: str) -> tuple[str, int, int, int, str]:
    """(file, offset, length, payload offset, key) of the biggest tensor item, from the manifest."""
    doc = json.load(open(os.path.join(path, MANIFEST_FILE)))
    rows = [(name, *row) for name, rows in doc["items"].items() for row in rows]
    name, offset, length, _, key = max(rows, key=lambda r: r[2])[:5]
    return name, offset, length, key


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _damage(case: str, path: str, root: str, marker: str) -> dict:
    """Rank 0's damage; returns what the test should find named in the error."""
    data_file = os.path.join(path, "__1_0.distcp")
    if case == "truncated":
        size = os.path.getsize(data_file)
        os.truncate(data_file, size // 2)
        return {"names": ["__1_0.distcp", "truncated"]}
    if case in ("corrupt_payload", "corrupt_framing"):
        name, offset, length, key = _largest_item(path)
        if case == "corrupt_framing":
            os.remove(os.path.join(path, MANIFEST_FILE))  # nothing to catch it but the framing check
            _flip(os.path.join(path, name), offset + 1)  # inside the first local header's signature
            return {"names": [name, key, "not a readable torch.save archive"]}
        _flip(os.path.join(path, name), offset + length // 2)
        return {"names": [name, key, "checksum mismatch"], "key": key}
    if case == "fifo":
        os.remove(data_file)
        os.mkfifo(data_file)
        return {"names": ["__1_0.distcp", "not a regular file"]}
    if case == "symlink_out":
        outside = os.path.join(root, "elsewhere.distcp")
        shutil.move(data_file, outside)
        os.symlink(outside, data_file)
        return {"names": ["__1_0.distcp", "outside the checkpoint"]}
    if case == "metadata_pickle":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_Evil(marker), f)
        return {"names": [".metadata", "posix.system"]}
    if case == "common_pickle":
        torch.save(_Evil(marker), os.path.join(path, "common.pt"))
        return {"names": ["common.pt", "posix.system"]}
    if case == "no_metadata_json":
        os.remove(os.path.join(path, "metadata.json"))
        return {"names": ["not a distributed checkpoint"]}
    if case == "integrity_json":  # Megatron's --verify-integrity manifest, then one data file changed
        import hashlib

        files = {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest()
                 for n in sorted(os.listdir(path))}
        with open(os.path.join(path, "integrity.json"), "w") as f:
            json.dump({"algorithm": "sha256", "files": files}, f)
        with open(data_file, "ab") as f:
            f.write(b"x")  # past every item: only the whole-file hash can see it
        return {"names": ["integrity verification failed", "__1_0.distcp: hash mismatch"]}
    return {}


def hostile(rank, world, root, case) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from tests.helpers.bodies.common import _st

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, case, "ckpt")
    marker = os.path.join(root, case, "code_ran")
    state = build_state(rank, world, tp=world, spec=spec, references=refs)
    admitted = ()
    if case == "object_class":  # a class the saver admits and the loader was not told about
        state["counts"] = ShardedObject("counts", fractions.Fraction(1, rank + 2), (world,), (rank,))
        admitted = (fractions.Fraction,)
    safe_ckpt.save(state, path, options=small_options(safe_globals=admitted))
    expect = _damage(case, path, os.path.join(root, case), marker) if rank == 0 else {}
    dist.barrier()

    # read back in the saved layout, so every stored item is read whole by some rank (and checksummed)
    layout = "save" if case == "corrupt_payload" else "alt"
    target = build_state(rank, world, tp=world, spec=spec, layout=layout, empty=True, references=refs)
    if case == "object_class":
        target["counts"] = ShardedObject("counts", None, (world,), (rank,))
        expect = {"names": ["fractions.Fraction", "LoadOptions(safe_globals"]}
    if case == "missing_key":
        target["model"]["not_saved"] = _st("not_saved", torch.empty(2, 4), (2 * world, 4), (2 * rank, 0))
        expect = {"names": ["not_saved", "not in the checkpoint"]}
    if case == "shape_mismatch":
        target["model"]["embedding.word_embeddings.weight"] = _st(
            "embedding.word_embeddings.weight", torch.empty(2, spec.hidden, dtype=torch.bfloat16),
            (2 * world, spec.hidden), (2 * rank, 0))
        expect = {"names": ["embedding.word_embeddings.weight", "global shape mismatch"]}
    out = {"expect": expect}
    try:
        safe_ckpt.load(target, path, load_options(), verify_integrity=case == "integrity_json")
        out["error"] = None
    except BaseException as exc:
        out["error"] = describe_exception(exc)
    out["code_ran"] = os.path.exists(marker)
    if case == "object_class":  # the remedy the message names works
        target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs)
        target["counts"] = ShardedObject("counts", None, (world,), (rank,))
        loaded = safe_ckpt.load(target, path, load_options(safe_globals=(fractions.Fraction,)))
        out["with_remedy"] = loaded["counts"] == fractions.Fraction(1, rank + 2)
    if case == "integrity_json":  # without the check it loads: the appended byte lies outside every item
        target = build_state(rank, world, tp=world, spec=spec, layout=layout, empty=True, references=refs)
        expected = build_state(rank, world, tp=world, spec=spec, layout=layout, references=refs)
        out["unchecked_mismatches"] = compare_loaded(safe_ckpt.load(target, path, load_options()), expected)
    if case == "corrupt_payload":  # skipping the check loads the damaged bytes, as stock would
        target = build_state(rank, world, tp=world, spec=spec, layout=layout, empty=True, references=refs)
        expected = build_state(rank, world, tp=world, spec=spec, layout=layout, references=refs)
        loaded = safe_ckpt.load(target, path, load_options(verify_checksums=False))
        out["unchecked_mismatches"] = compare_loaded(loaded, expected)
    return out


def every_case(rank, world, root) -> dict:
    """Every case in one world (starting ranks is what takes the time)."""
    return {case: hostile(rank, world, root, case) for case in CASES}
