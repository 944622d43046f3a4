"""Evidence for the real-GPT GPU test (tests/helpers/bodies/gpu_megatron.py): digests of a
DistributedOptimizer's state, a byte comparison of two torch_dist directories read with stock
torch.distributed.checkpoint, and the repair of torch Adam's 'step' after a megatron-core 0.19
load without TE/Apex. Pure Python over torch; imported only where the test runs."""

from __future__ import annotations

import torch


def _dist_optimizers(optimizer):
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(o, "gbuf_ranges")]


def _state_dicts(inner):
    """Every per-parameter state dict of a torch optimizer, and of a HybridDeviceOptimizer's
    sub-optimizers (whose dicts it shares, but set both in case they were rebuilt)."""
    found = {}
    for opt in [inner, *getattr(inner, "sub_optimizers", [])]:
        for st in opt.state.values():
            found[id(st)] = st
    return list(found.values())


def restore_adam_steps(optimizer) -> dict:
    """Give torch Adam's per-parameter 'step' the value the checkpoint records.

    megatron-core 0.19 without TE/Apex (HAVE_APEX_OR_TE False) stores 'step' only in the
    optimizer's param_groups (DistributedOptimizer.state_dict). Loading, load_state_dict sets
    one tensor of that value, shared by every parameter, into the state, and then
    load_parameter_state_from_dp_reshardable -> _set_main_param_and_optimizer_states copies
    over it (or, with a HybridDeviceOptimizer, assigns) the 'step' kept as a
    LocalNonpersistentObject in the loading sharded state dict: the tensor of the pre-load
    state, i.e. the dummy step (1). One shared tensor is moreover bumped once per parameter by
    torch's foreach/fused Adam. Stock Megatron training never reaches this path (it asserts
    without TE/Apex before loading). The value used here is the checkpoint's own: the
    param_groups 'step' that load_state_dict restored from it."""
    info = []
    for opt in _dist_optimizers(optimizer):
        inner = opt.optimizer
        recorded = sorted({float(g["step"]) for g in inner.param_groups
                           if g.get("params") and g.get("step") is not None})
        states = [st for st in _state_dicts(inner) if isinstance(st.get("step"), torch.Tensor)]
        entry = {"checkpoint_step": recorded, "states": len(states),
                 "steps_before": sorted({float(st["step"]) for st in states}),
                 "distinct_step_tensors_before": len({id(st["step"]) for st in states})}
        if len(recorded) == 1:
            for st in states:
                old = st["step"]
                st["step"] = torch.tensor(recorded[0], dtype=old.dtype, device=old.device)
        entry["steps_after"] = sorted({float(st["step"]) for st in states})
        info.append(entry)
    return {"optimizers": info}


def _tensor_digest(t):
    import hashlib

    t = t.detach().contiguous().reshape(-1)
    return [float(t.double().sum()), hashlib.sha1(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]]


def opt_digest(optimizer, scheduler) -> dict:
    """Per model parameter (by name): sum and sha1 of the fp32 main param the next step updates,
    of each Adam moment, and the 'step'; per param group: lr, weight decay."""
    out = {"params": {}, "groups": [], "group_steps": [], "step_values": [], "distinct_step_tensors": 0,
           "scheduler_num_steps": getattr(scheduler, "num_steps", None)}
    step_ids = set()
    for i, opt in enumerate(_dist_optimizers(optimizer)):
        inner = opt.optimizer
        fp32_of = getattr(inner, "param_to_fp32_param", {})  # HybridDeviceOptimizer's working copies
        for gbuf_range_maps in opt.gbuf_ranges:
            for per_bucket in gbuf_range_maps.values():
                for bucket in per_bucket:
                    for model_param in bucket["param_map"]:
                        tensors = opt._get_main_param_and_optimizer_states(model_param)
                        gi, go = opt.model_param_group_index_map[model_param]
                        shard = inner.param_groups[gi]["params"][go]
                        if shard in fp32_of:
                            tensors["param"] = fp32_of[shard]
                        entry = {}
                        for k, v in sorted(tensors.items()):
                            if not isinstance(v, torch.Tensor):
                                continue
                            if k == "step":
                                entry[k] = float(v)
                                step_ids.add(id(v))
                            else:
                                entry[k] = _tensor_digest(v)
                        out["params"][f"{i}:{opt._param_name(model_param)}"] = entry
        for g in inner.param_groups:
            out["groups"].append({"lr": float(g["lr"]), "weight_decay": float(g.get("weight_decay", 0.0)),
                                  "n": len(g["params"])})
            out["group_steps"].append(None if g.get("step") is None else float(g["step"]))
    out["step_values"] = sorted({e["step"] for e in out["params"].values() if "step" in e})
    out["distinct_step_tensors"] = len(step_ids)
    return out


def evidence(fn, *args):
    """A diagnostic's result, or its error: evidence must not fail the run it describes."""
    try:
        return fn(*args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def diff_digests(a: dict, b: dict) -> list[str]:
    """Where two opt_digest results differ (param group 'step' keys left out: torch Adam has none
    before a load, megatron puts the checkpoint's there on load), e.g.
    diff_digests(saved[0]["opt_digest"], resumed[0]["opt_digest"]) should be []."""
    if "error" in a or "error" in b:
        return [f"digest error: {a.get('error')} / {b.get('error')}"]
    diffs = []
    for name in sorted(set(a["params"]) | set(b["params"])):
        ea, eb = a["params"].get(name), b["params"].get(name)
        if ea is None or eb is None:
            diffs.append(f"{name}: only in {'b' if ea is None else 'a'}")
            continue
        for k in sorted(set(ea) | set(eb)):
            if ea.get(k) != eb.get(k):
                diffs.append(f"{name}.{k}: {ea.get(k)} != {eb.get(k)}")
    if a["groups"] != b["groups"]:
        diffs.append(f"groups: {a['groups']} != {b['groups']}")
    if a["scheduler_num_steps"] != b["scheduler_num_steps"]:
        diffs.append(f"scheduler_num_steps: {a['scheduler_num_steps']} != {b['scheduler_num_steps']}")
    if a["distinct_step_tensors"] != b["distinct_step_tensors"]:
        diffs.append(f"distinct_step_tensors: {a['distinct_step_tensors']} != {b['distinct_step_tensors']}")
    return diffs


def _same(a, b) -> bool:
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                           b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and hasattr(b, "__dict__") and type(a) is type(b):
        return _same(vars(a), vars(b))
    try:
        return bool(a == b)
    except Exception:
        return False


def _read_dcp(path: str) -> dict:
    """Every entry of a torch_dist checkpoint, read with stock torch.distributed.checkpoint into
    tensors allocated from its .metadata; objects come back as their raw stored bytes."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class RawBytesPlanner(DefaultLoadPlanner):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.raw = {}

        def load_bytes(self, read_item, value):
            self.raw[read_item.dest_index.fqn] = value.read()

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {fqn: torch.zeros(tuple(m.size), dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata)
          else io.BytesIO() for fqn, m in md.items()}
    planner = RawBytesPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(sd, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    missing = [fqn for fqn, v in sd.items() if isinstance(v, io.BytesIO) and fqn not in planner.raw]
    if missing:
        raise RuntimeError(f"objects not read back: {missing[:5]}")
    sd.update(planner.raw)
    return sd


def compare_contents(ours: str, stock: str) -> dict:
    """Byte comparison of everything both directories store. "differ": fqns whose tensor bytes
    differ, or whose object differs (raw bytes and unpickled value both); should be []."""
    import io

    try:
        a, b = _read_dcp(ours), _read_dcp(stock)
        differ, raw_only = [], []
        for fqn in sorted(set(a) & set(b)):
            x, y = a[fqn], b[fqn]
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                if not _same(x, y):
                    differ.append(fqn)
            elif x != y:
                if _same(torch.load(io.BytesIO(x), weights_only=False), torch.load(io.BytesIO(y), weights_only=False)):
                    raw_only.append(fqn)
                else:
                    differ.append(fqn)
        from megatron.core import dist_checkpointing

        ca, cb = dist_checkpointing.load_common_state_dict(ours), dist_checkpointing.load_common_state_dict(stock)
        common_differ = sorted(k for k in set(ca) & set(cb) if not _same(ca[k], cb[k]))
        args_differ = []
        if "args" in common_differ and hasattr(ca["args"], "__dict__") and hasattr(cb["args"], "__dict__"):
            va, vb = vars(ca["args"]), vars(cb["args"])
            args_differ = sorted(k for k in set(va) | set(vb) if not _same(va.get(k), vb.get(k)))
        return {
            "differ": differ,
            "tensors": sum(isinstance(v, torch.Tensor) for v in a.values()),
            "objects": sum(not isinstance(v, torch.Tensor) for v in a.values()),
            "only_ours": sorted(set(a) - set(b))[:10], "only_stock": sorted(set(b) - set(a))[:10],
            "only_ours_count": len(set(a) - set(b)), "only_stock_count": len(set(b) - set(a)),
            "object_bytes_differ_value_equal": raw_only,
            "common_differ": common_differ, "common_args_differ": args_differ,
            "common_only_ours": sorted(set(ca) - set(cb)), "common_only_stock": sorted(set(cb) - set(ca)),
        }
    except Exception as e:  # keep the save's other evidence; make any assert on "differ" fail
        import traceback

        return {"differ": None, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
