"""`safe-ckpt inspect DIR`: what a torch_dist checkpoint holds.

One job: summarise keys, shapes, dtypes and chunks, objects, bytes per rank and per
file, the distributed-optimizer sharding type (from the checkpoint's content metadata,
the optimizer's common state, or else inferred from its keys) and the iteration, as a
dict (for `--json`) and as text. Files are opened through `safe_read.files` (regular files
inside the directory only); an entry that is not one is listed with what it is, never read.
Must not: modify anything, or unpickle anything except through `safe_read` (restricted
`.metadata`, weights-only common state).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

from ..names import CONFIG_FILE, DATA_FILE, METADATA_FILE, SHARDED_BACKEND, TRACKER_FILE
from ..encoding.safe_read.files import describe, open_file, read_file
from ..encoding.safe_read import UnreadableCheckpointError, load_common_state, read_metadata
from ..units import counted

_MAX_CONFIG_BYTES = 16 << 20

# How megatron-core's distributed optimizer names what each sharding type stores.
_BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.*\.bucket_idx_\d+\.")
_DP_ZERO_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_\d+\.param_state(/|$)")
_MODEL_SPACE_KEY = re.compile(r"^optimizer\.state\.")


def inspect(directory: str) -> dict:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = os.path.abspath(directory)
    if not os.path.lexists(os.path.join(directory, METADATA_FILE)):
        raise UnreadableCheckpointError(os.path.join(directory, METADATA_FILE),
                                        "missing: this is not a torch_dist checkpoint")
    meta = read_metadata(directory)
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
        kind = describe(directory, name)
        m = DATA_FILE.match(name)
        files[name] = {"bytes": kind.size_bytes, "rank": int(m.group(1)) if m else None}
        if not kind.regular:
            files[name]["not_read"] = kind.description
        if m:
            per_rank[int(m.group(1))] += kind.size_bytes
    out = {
        "directory": directory,
        "config": _config(directory),
        "tensors": tensors, "objects": objects, "files": files,
        "bytes_per_rank": dict(sorted(per_rank.items())),
        "total_bytes": sum(f["bytes"] for f in files.values()),
    }
    common = load_common_state(directory, meta)
    if not isinstance(common, dict):
        common = {}
    out["iteration"] = common.get("iteration")
    out["checkpoint_version"] = common.get("checkpoint_version")
    out["common_keys"] = sorted(map(str, common))
    sharding, source = optimizer_sharding(common, list(tensors), list(objects))
    out["distrib_optim_sharding_type"], out["distrib_optim_sharding_source"] = sharding, source
    save_root = os.path.dirname(directory)
    if os.path.lexists(os.path.join(save_root, TRACKER_FILE)):
        try:
            with open_file(save_root, TRACKER_FILE) as f:
                out["tracker"] = f.read_range(0, 64).decode(errors="replace").strip()
        except UnreadableCheckpointError as exc:
            out["tracker"] = f"<not read: {exc.reason}>"
    return out


def _config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.lexists(path):
        return {}  # a stock DCP checkpoint: Megatron's metadata.json is absent
    try:
        config = json.loads(read_file(directory, CONFIG_FILE, _MAX_CONFIG_BYTES, CONFIG_FILE))
    except (ValueError, RecursionError) as exc:
        raise UnreadableCheckpointError(path, f"is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UnreadableCheckpointError(path, f"holds a {type(config).__name__}, not a JSON object")
    return config


def _find_key(tree, key: str, depth: int = 0):
    """The first value stored under ``key`` in nested dicts / lists (chained optimizers nest)."""
    if depth > 6:
        return None
    if isinstance(tree, dict):
        if isinstance(tree.get(key), str):
            return tree[key]
        children = tree.values()
    elif isinstance(tree, (list, tuple)):
        children = tree
    else:
        return None
    for child in children:
        found = _find_key(child, key, depth + 1)
        if found is not None:
            return found
    return None


def optimizer_sharding(common: dict, tensor_keys: list[str], object_keys: list[str]) -> tuple[str | None, str]:
    """The distributed-optimizer sharding type and where it was read (or how it was inferred)."""
    content = common.get("content_metadata")
    if isinstance(content, dict) and isinstance(content.get("distrib_optim_sharding_type"), str):
        return content["distrib_optim_sharding_type"], "content_metadata"
    found = _find_key(common.get("optimizer"), "param_state_sharding_type")
    if found is not None:
        return found, "the optimizer's common state"
    if any(_BUCKET_KEY.match(k) for k in tensor_keys):
        return "dp_reshardable", "inferred from optimizer.distributed.*.bucket_idx_* keys"
    if any(_DP_ZERO_KEY.match(k) for k in object_keys):
        return "dp_zero_gather_scatter", "inferred from an optimizer.distributed.*.param_state object"
    if any(_MODEL_SPACE_KEY.match(k) for k in tensor_keys):
        return "fully_reshardable or fully_sharded_model_space", "inferred from optimizer.state.* keys"
    return None, "no distributed-optimizer state"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def to_text(info: dict) -> str:
    config = info["config"]
    backend = (f"backend {config.get('sharded_backend')} v{config.get('sharded_backend_version')}" if config
               else f"no {CONFIG_FILE} (a DCP checkpoint, not Megatron's {SHARDED_BACKEND})")
    lines = [f"checkpoint {info['directory']}",
             f"  {backend}; iteration {info.get('iteration')}"
             + (f"; tracker -> {info['tracker']}" if "tracker" in info else ""),
             f"  optimizer sharding {info.get('distrib_optim_sharding_type') or 'none'} "
             f"({info.get('distrib_optim_sharding_source')})",
             f"  {counted(len(info['tensors']), 'tensor')}, {counted(len(info['objects']), 'object')}, "
             f"{counted(len(info['files']), 'file')}, "
             f"{_human(info['total_bytes'])}",
             "  bytes per rank: " + ", ".join(f"{r}: {_human(b)}" for r, b in info["bytes_per_rank"].items()),
             "", "  tensors:"]
    width = max((len(k) for k in info["tensors"]), default=10)
    for key, t in info["tensors"].items():
        lines.append(f"    {key:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<22} "
                     f"{t['chunks']:>4} chunk(s)  {_human(t['stored_bytes'])}")
    if info["objects"]:
        lines += ["", "  objects:"] + [f"    {k}  {_human(o['stored_bytes'])}" for k, o in info["objects"].items()]
    lines += ["", "  files:"] + [f"    {n:<28} " + (f"not read: {f['not_read']}" if "not_read" in f else
                                                  _human(f["bytes"])) for n, f in info["files"].items()]
    return "\n".join(lines)
