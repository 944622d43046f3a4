"""A real GPTModel with Megatron's DistributedOptimizer: train, save with safe_ckpt, resume with
stock `load_checkpoint`, and compare losses with an uninterrupted run. Needs CUDA and
Megatron-LM's `megatron.training` on the path (see README, GPU machine)."""

from __future__ import annotations

import os
import sys

import torch

MODEL_ARGS = """--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64
--max-position-embeddings 64 --micro-batch-size 2 --train-iters 40 --lr 1e-3 --min-lr 1e-4
--lr-decay-style cosine --lr-warmup-iters 2 --bf16 --use-distributed-optimizer
--tokenizer-type NullTokenizer --vocab-size 511 --ckpt-format torch_dist --transformer-impl local
--no-gradient-accumulation-fusion --attention-dropout 0 --hidden-dropout 0 --seed 1234
--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm
--normalization RMSNorm --position-embedding-type rope --no-rope-fusion
--untie-embeddings-and-output-weights --attention-backend unfused --log-interval 1000
--save-interval 1000 --eval-iters 0""".split()

VARIANTS = {
    "gpu": [],
    "cpu_offload_pinned": ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--optimizer-offload-fraction",
                           "1.0"],
    "cpu_offload_pageable_grads": ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                                   "--optimizer-offload-fraction", "1.0", "--no-pin-cpu-grads"],
}


def _model_provider(pre_process=True, post_process=True, **kwargs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = kwargs.get("config") or core_transformer_config_from_args(args)
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=False, position_embedding_type=args.position_embedding_type,
    )


def _setup(save_dir, variant, world):
    sys.argv = ["safe_ckpt_gpu_test", *MODEL_ARGS, "--global-batch-size", str(2 * world), "--save", save_dir,
                *VARIANTS[variant]]
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    import inspect

    import megatron.training.initialize as megatron_init

    # The test feeds its own batches: skip building Megatron's C++ dataset helpers
    # (the carried megatron-core sits on a read-only path there).
    megatron_init._compile_dependencies = lambda *a, **k: None
    if "extra_args_provider" not in inspect.signature(initialize_megatron).parameters:
        from megatron.training.arguments import parse_and_validate_args  # >= 0.19 parses first

        parse_and_validate_args()
    initialize_megatron()
    model, optimizer, scheduler = setup_model_and_optimizer(model_type=ModelType.encoder_or_decoder,
                                                            model_provider_func=_model_provider)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler


def _batch(iteration, args):
    from megatron.core import mpu

    g = torch.Generator().manual_seed(10_000 * iteration + mpu.get_data_parallel_rank())
    tokens = torch.randint(0, 500, (args.micro_batch_size, args.seq_length + 1), generator=g).cuda()
    positions = torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1).cuda()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions


def _train(model, optimizer, scheduler, start, stop) -> list[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    forward_backward = get_forward_backward_func()
    losses = []
    for it in range(start, stop):
        tokens, labels, positions = _batch(it, args)

        def forward_step(data_iterator, m):
            out = m(tokens, positions, None, labels=labels)

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"lm loss": loss.detach()}

            return out, loss_func

        data = RerunDataIterator(iter([None] * 4))
        rerun = get_rerun_state_machine()
        while rerun.should_run_forward_backward(data):  # Megatron's train_step wraps the pass so
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            result = forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                                      num_microbatches=1, seq_length=args.seq_length,
                                      micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                                      forward_only=False)
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        losses.append(float(result[0]["lm loss"].item()))
    return losses


FIRST, SECOND = 6, 6


def run(rank, world, root, variant, mode) -> dict:
    """mode: "full" (train FIRST+SECOND), "save" (train FIRST, save with safe_ckpt and with stock
    Megatron), "resume" / "resume_stock" (stock load_checkpoint of the safe_ckpt / the stock
    checkpoint, train SECOND)."""
    import safe_ckpt.megatron as safe_megatron

    save_dir = os.path.join(root, "stock" if mode == "resume_stock" else "safe")
    model, optimizer, scheduler = _setup(save_dir, variant, world)
    from megatron.training import get_args

    args = get_args()
    out = {"start_iteration": args.iteration}
    if mode == "full":
        out["losses"] = _train(model, optimizer, scheduler, 0, FIRST + SECOND)
    elif mode == "save":
        out["losses"] = _train(model, optimizer, scheduler, 0, FIRST)
        out["opt_digest"] = _evidence(opt_digest, optimizer, scheduler)  # the state both checkpoints hold
        from safe_ckpt.bench.measure import count_memcpy

        # The whole drop-in (Megatron's own state-dict construction included) under the profiler.
        out["save_memcpy"] = count_memcpy(lambda: safe_megatron.save_checkpoint(
            FIRST, model, optimizer, scheduler, num_floating_point_operations_so_far=0))
        # The same state through stock Megatron, to compare the directories.
        from megatron.training.checkpointing import save_checkpoint as stock_save

        args.save = os.path.join(root, "stock")
        stock_save(FIRST, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
        args.save = save_dir
        torch.distributed.barrier()
        if rank == 0:
            out["compare"] = compare_dirs(os.path.join(root, "safe", "iter_%07d" % FIRST),
                                          os.path.join(root, "stock", "iter_%07d" % FIRST))
            out["tracker"] = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read()
            # Every stored tensor and object, read back with torch.distributed.checkpoint alone.
            out["content"] = compare_contents(os.path.join(root, "safe", "iter_%07d" % FIRST),
                                              os.path.join(root, "stock", "iter_%07d" % FIRST))
    else:
        from megatron.training.checkpointing import load_checkpoint

        # Without Transformer Engine or Apex, megatron-core's DistributedOptimizer can build a
        # loading state dict only once torch's Adam has state (it reads 'step' from it); stock
        # training gets that from TE's FusedAdam. Dummy states are overwritten by the load, all
        # but torch Adam's per-parameter 'step' (see restore_adam_steps).
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if init is not None:
                init()
        args.load = save_dir
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(model, optimizer, scheduler)
        out["start_iteration"] = args.iteration
        out["opt_digest_as_loaded"] = _evidence(opt_digest, optimizer, scheduler)  # stock load, untouched
        if os.environ.get("SAFE_CKPT_TEST_NO_STEP_REPAIR") != "1":
            out["adam_step_repair"] = restore_adam_steps(optimizer)
        out["opt_digest"] = _evidence(opt_digest, optimizer, scheduler)  # what training resumes from
        out["losses"] = _train(model, optimizer, scheduler, args.iteration, args.iteration + SECOND)
    return out


def compare_dirs(ours: str, stock: str) -> dict:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def describe(path):
        md = FileSystemReader(path).read_metadata().state_dict_metadata
        return {k: (tuple(v.size), str(v.properties.dtype)) if isinstance(v, TensorStorageMetadata) else "bytes"
                for k, v in md.items()}

    a, b = describe(ours), describe(stock)
    ca = set(dist_checkpointing.load_common_state_dict(ours))
    cb = set(dist_checkpointing.load_common_state_dict(stock))
    fa = sorted(f for f in os.listdir(ours) if not f.endswith(".distcp"))
    fb = sorted(f for f in os.listdir(stock) if not f.endswith(".distcp"))
    return {
        "metadata_equal": a == b,
        "only_ours": sorted(set(a) - set(b))[:10], "only_stock": sorted(set(b) - set(a))[:10],
        "differ": sorted(k for k in set(a) & set(b) if a[k] != b[k])[:10],
        "common_equal": ca == cb, "common_only_ours": sorted(ca - cb), "common_only_stock": sorted(cb - ca),
        "files_ours": fa, "files_stock": fb,
    }


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


def _evidence(fn, *args):
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
            "object_bytes_differ_value_equal": raw_only,
            "common_differ": common_differ, "common_args_differ": args_differ,
        }
    except Exception as e:  # keep the save's other evidence; make any assert on "differ" fail
        import traceback

        return {"differ": None, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
