"""A real GPTModel with Megatron's DistributedOptimizer: train, save with safe_ckpt, resume with
stock `load_checkpoint`, and compare losses with an uninterrupted run. Needs CUDA and
Megatron-LM's `megatron.training` on the path (see benchmarks/README.md, "Reproducing")."""

from __future__ import annotations

import os
import sys

import torch

from tests.helpers.megatron_evidence import compare_contents, opt_digest, restore_adam_steps, evidence

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
    # Megatron sizes data parallelism from RANK/WORLD_SIZE while parsing arguments, before it
    # finds torch.distributed already initialized by the test's process group
    os.environ["RANK"] = str(torch.distributed.get_rank())
    os.environ["WORLD_SIZE"] = str(world)
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
        out["opt_digest"] = evidence(opt_digest, optimizer, scheduler)  # the state both checkpoints hold
        from safe_ckpt_lab.bench.measure import count_memcpy

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
        out["opt_digest_as_loaded"] = evidence(opt_digest, optimizer, scheduler)  # stock load, untouched
        if os.environ.get("SAFE_CKPT_TEST_NO_STEP_REPAIR") != "1":
            out["adam_step_repair"] = restore_adam_steps(optimizer)
        out["opt_digest"] = evidence(opt_digest, optimizer, scheduler)  # what training resumes from
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
