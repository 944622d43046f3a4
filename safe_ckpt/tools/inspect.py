"""`safe-ckpt inspect DIR`: what a torch_dist checkpoint holds.

One job: summarise keys, shapes, dtypes and chunks, objects, bytes per rank and per
file, the distributed-optimizer sharding type and the iteration, as a dict (for
`--json`) and as text. Must not: modify anything; unpickle only what stock Megatron's
loader would (the common state, through megatron-core).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

_DATA_FILE = re.compile(r"^__(\d+)_(\d+)(?:-[0-9a-f]+)?\.distcp$")


def inspect(directory: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = os.path.abspath(directory)
    meta = FileSystemReader(directory).read_metadata()
    tensors, objects = {}, {}
    item_bytes: dict[str, int] = defaultdict(int)
    for index, info in meta.storage_data.items():
        item_bytes[index.fqn] += info.length
    for fqn, md in sorted(meta.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = {"shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", ""),
                            "chunks": len(md.chunks), "stored_bytes": item_bytes[fqn]}
        else:
            objects[fqn] = {"stored_bytes": item_bytes[fqn]}
    files, per_rank = {}, defaultdict(int)
    for name in sorted(os.listdir(directory)):
        size = os.path.getsize(os.path.join(directory, name))
        m = _DATA_FILE.match(name)
        files[name] = {"bytes": size, "rank": int(m.group(1)) if m else None}
        if m:
            per_rank[int(m.group(1))] += size
    out = {
        "directory": directory,
        "config": json.load(open(os.path.join(directory, "metadata.json"))),
        "tensors": tensors, "objects": objects, "files": files,
        "bytes_per_rank": dict(sorted(per_rank.items())),
        "total_bytes": sum(f["bytes"] for f in files.values()),
    }
    out.update(_common(directory))
    tracker = os.path.join(os.path.dirname(directory), "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        out["tracker"] = open(tracker).read().strip()
    return out


def _common(directory: str) -> dict:
    try:
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(directory)
    except Exception as exc:  # no megatron-core, or not a Megatron checkpoint
        return {"common_state_error": f"{type(exc).__name__}: {exc}"}
    content = common.get("content_metadata") or {}
    return {
        "iteration": common.get("iteration"),
        "checkpoint_version": common.get("checkpoint_version"),
        "distrib_optim_sharding_type": content.get("distrib_optim_sharding_type"),
        "common_keys": sorted(map(str, common)),
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def to_text(info: dict) -> str:
    lines = [f"checkpoint {info['directory']}",
             f"  backend {info['config'].get('sharded_backend')} v{info['config'].get('sharded_backend_version')}; "
             f"iteration {info.get('iteration')}; optimizer sharding {info.get('distrib_optim_sharding_type')}"
             + (f"; tracker -> {info['tracker']}" if "tracker" in info else ""),
             f"  {len(info['tensors'])} tensors, {len(info['objects'])} objects, {len(info['files'])} files, "
             f"{_human(info['total_bytes'])}",
             "  bytes per rank: " + ", ".join(f"{r}: {_human(b)}" for r, b in info["bytes_per_rank"].items()),
             "", "  tensors:"]
    width = max((len(k) for k in info["tensors"]), default=10)
    for key, t in info["tensors"].items():
        lines.append(f"    {key:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<22} "
                     f"{t['chunks']:>4} chunk(s)  {_human(t['stored_bytes'])}")
    if info["objects"]:
        lines += ["", "  objects:"] + [f"    {k}  {_human(o['stored_bytes'])}" for k, o in info["objects"].items()]
    lines += ["", "  files:"] + [f"    {n:<28} {_human(f['bytes'])}" for n, f in info["files"].items()]
    return "\n".join(lines)
