"""slime (THUDM/slime) integration: `--ckpt-backend safe`.

One job: route slime's checkpoint save to `safe_ckpt.megatron.save_checkpoint` without
editing slime. slime's save path is `train.py` -> `RayTrainGroup.save_model` ->
`MegatronTrainRayActor.save_model` -> `slime.backends.megatron_utils.model.save`, which
calls the name `save_checkpoint` bound in that module; `install` rebinds that name in
every train actor (it runs there through `--custom-megatron-init-path`). Every actor is
one rank of a collective save over gloo: the checkpoint and the tracker file appear
only when all actors succeeded, and a failing actor makes every actor raise the same
`CheckpointError`, so `ray.get` in the driver raises it. No NCCL process group is needed
for the save, and paused (offloaded) memory is refused with a clear error, or read from
torch_memory_saver's CPU backup with `--safe-ckpt-unmapped-policy cpu_backup`.

slime's checkpoint load (the actor's `init`, `--release-train`'s reload) goes through
`safe_ckpt.megatron.load_checkpoint` too (`slime_load`; `--safe-ckpt-stock-load` keeps Megatron's).

With `--offload-train`, `install` also replaces the actor's `save_model` so that an asleep actor
saves without waking up (`slime_asleep`; `--safe-ckpt-save-awake` turns that off).

Ways to enable it:
- `python -m safe_ckpt.integrations.slime <train.py arguments> --ckpt-backend safe` (its `--help`
  works without slime; without slime any other call is one line naming the remedy, exit 2)
- or add to slime's command line `--custom-megatron-init-path safe_ckpt.integrations.slime.install`
  and pass `add_custom_arguments=safe_ckpt.integrations.slime.add_arguments` to
  `slime.utils.arguments.parse_args` (see README, "With slime").

Must not: change slime's behaviour with `--ckpt-backend megatron` (the default).
"""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import sys

log = logging.getLogger("safe_ckpt")

SLIME_MODEL_MODULE = "slime.backends.megatron_utils.model"
SLIME_BACKUPER_MODULE = "slime.utils.tensor_backper"
INIT_HOOK = "safe_ckpt.integrations.slime.install"


def add_arguments(parser):
    """Register `--ckpt-backend` and the safe_ckpt options on slime's (Megatron's) parser."""
    group = parser.add_argument_group("safe_ckpt")
    group.add_argument("--ckpt-backend", choices=["megatron", "safe"], default="megatron",
                       help="who writes torch_dist checkpoints: stock Megatron or safe_ckpt")
    group.add_argument("--safe-ckpt-staging-budget-gib", type=float, default=None,
                       help="pinned staging pool per rank, allocated once (default: 1/16 of the rank's share of "
                            "the host's available memory, at most 2 GiB)")
    group.add_argument("--safe-ckpt-io-threads", type=int, default=None,
                       help="writer threads per rank (default: the rank's share of the host's cores, within [1, 16])")
    group.add_argument("--safe-ckpt-writer-nice", type=int, default=None,
                       help="how much nicer than the training thread the writer threads run (default 5; 0: not)")
    group.add_argument("--safe-ckpt-unmapped-policy", choices=["error", "cpu_backup"], default="error",
                       help="paused GPU memory: refuse (error) or read torch_memory_saver's CPU backup")
    group.add_argument("--safe-ckpt-timeout-s", type=float, default=None,
                       help="how long a rank waits for the others in a save (default 600)")
    group.add_argument("--safe-ckpt-keep-last", type=int, default=None, help="keep only the newest N iterations")
    group.add_argument("--safe-ckpt-keep-every", type=int, default=None, help="... and every K-th iteration")
    group.add_argument("--safe-ckpt-save-awake", action="store_true",
                       help="with --offload-train, save as slime does (wake up, save, sleep) instead of "
                            "saving asleep from torch_memory_saver's CPU backup")
    group.add_argument("--safe-ckpt-stock-load", action="store_true",
                       help="with --ckpt-backend safe, keep Megatron's own checkpoint load (by default the actor's "
                            "load goes through safe_ckpt too)")
    group.add_argument("--safe-ckpt-overlap-copy", action="store_true",
                       help="with --async-save, return from the save right after planning and copy the GPU state "
                            "during the next step's forward and backward (its optimizer step waits for what is "
                            "left); falls back to the staged return, naming why, where the setup is not eligible")
    group.add_argument("--safe-ckpt-chained-init-path", type=str, default=None,
                       help="another --custom-megatron-init-path hook to run first (set by the launcher)")
    return parser


def slime_save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0,
                          checkpointing_context=None, train_data_iterator=None,
                          preprocess_common_state_dict_fn=None, **kwargs):
    """What slime's `save` calls in place of Megatron's `save_checkpoint` (same arguments). The
    classes slime's args hold are admitted to the saved common state, as slime's loaders admit
    them (`slime_load`; its patched Megatron loads with `weights_only=False`)."""
    from megatron.training.global_vars import get_args

    from safe_ckpt.megatron import save_checkpoint

    from .slime_load import classes_in_args

    return save_checkpoint(iteration, model, optimizer, opt_param_scheduler, safe_globals=classes_in_args(get_args()),
                           num_floating_point_operations_so_far=num_floating_point_operations_so_far,
                           checkpointing_context=checkpointing_context, train_data_iterator=train_data_iterator,
                           preprocess_common_state_dict_fn=preprocess_common_state_dict_fn, **kwargs)


def _patch_async_finalize() -> None:
    """Make Megatron's `maybe_finalize_async_save` (which slime's actor calls around saves)
    also finish safe_ckpt's asynchronous saves, which are not in Megatron's queue."""
    try:
        async_utils = importlib.import_module("megatron.training.async_utils")
    except ImportError:
        return
    original = getattr(async_utils, "maybe_finalize_async_save", None)
    if original is not None:
        from safe_ckpt.megatron import finalizing_too

        async_utils.maybe_finalize_async_save = finalizing_too(original)


def _guard_writers_of_saved_tensors(backuper_module: str | None = None) -> None:
    """An overlapped save's copies may still be reading the weights when slime writes them: make
    torch_memory_saver's `pause` wait for the copies, and every `TensorBackuper.restore` (the
    weight switch of `wake_up` and of the ref/teacher log-probs) wait at the gate first."""
    from ..staging import gates

    gates.guard_memory_saver()
    try:
        module = importlib.import_module(backuper_module or SLIME_BACKUPER_MODULE)
    except ImportError:
        return
    base = getattr(module, "TensorBackuper", None)
    todo, classes = [base] if isinstance(base, type) else [], []
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        restore = vars(cls).get("restore")
        if restore is None or getattr(restore, "__isabstractmethod__", False) or getattr(restore, "_safe_ckpt", False):
            continue

        def gated(self, *args, _inner=restore, **kwargs):
            gates.before_update("TensorBackuper.restore()")
            return _inner(self, *args, **kwargs)

        gated._safe_ckpt = True
        cls.restore = gated


def install(args, model_module: str | None = None) -> None:
    """`--custom-megatron-init-path safe_ckpt.integrations.slime.install`: runs in every train
    actor after Megatron is initialised, before the actor's load; with `--ckpt-backend safe`, slime's
    save, and its load unless `--safe-ckpt-stock-load`, go through safe_ckpt."""
    chained = getattr(args, "safe_ckpt_chained_init_path", None)
    if chained:
        module_name, _, func = chained.rpartition(".")
        getattr(importlib.import_module(module_name), func)(args)
    if getattr(args, "ckpt_backend", "megatron") != "safe":
        return
    module = importlib.import_module(model_module or getattr(args, "safe_ckpt_model_module", None)
                                     or SLIME_MODEL_MODULE)
    if not hasattr(module, "save_checkpoint"):
        raise RuntimeError(f"{module.__name__} has no save_checkpoint to replace: unsupported slime version")
    module.save_checkpoint = slime_save_checkpoint
    _patch_async_finalize()
    _guard_writers_of_saved_tensors(getattr(args, "safe_ckpt_backuper_module", None))
    from .slime_load import install_load

    install_load(args)
    # Runs before slime's own load: the tracker read now is the one that load reads (retention keeps it).
    from ..megatron import training

    training.note_loaded_from_args(args)
    log.info("slime checkpoints now go through safe_ckpt (%s.save_checkpoint)", module.__name__)
    from .slime_asleep import install_on_actor

    saves = install_on_actor(args)
    if saves is not None:
        module.save_checkpoint = saves.routing(slime_save_checkpoint)


def _launcher_argv(argv: list[str]) -> list[str]:
    """Put our init hook on the command line, chaining any hook the user already set."""
    argv = list(argv)
    if "--custom-megatron-init-path" in argv:
        i = argv.index("--custom-megatron-init-path")
        if argv[i + 1] != INIT_HOOK:
            argv += ["--safe-ckpt-chained-init-path", argv[i + 1]]
            argv[i + 1] = INIT_HOOK
    else:
        argv += ["--custom-megatron-init-path", INIT_HOOK]
    return argv


LAUNCHER = "python -m safe_ckpt.integrations.slime"
INSTALL_REMEDY = ("install slime in this environment (pip install -e /path/to/slime) or pass "
                  "--slime-train-script /path/to/slime/train.py")


class LauncherError(Exception):
    """A launcher call that cannot start slime; its message is the one line the user sees."""


def launcher_help() -> str:
    """The launcher's own help: what it does, its one flag, and the flags it registers on slime's parser."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=LAUNCHER, usage=f"{LAUNCHER} [--slime-train-script PATH] <slime train.py arguments>",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start slime's train.py with safe_ckpt's init hook and flags. Every argument but\n"
            "--slime-train-script goes to train.py unchanged; the launcher adds\n"
            f"--custom-megatron-init-path {INIT_HOOK} (chaining a hook you pass)\n"
            "and registers the safe_ckpt flags below, which act with --ckpt-backend safe.\n"
            "slime's own flags: python /path/to/slime/train.py --help"))
    parser.add_argument("--slime-train-script", metavar="PATH",
                        help="slime's train.py (default: the train.py beside the installed slime package)")
    add_arguments(parser)
    return parser.format_help()


def _find_train_script(argv: list[str]) -> tuple[str, list[str]]:
    script = None
    if "--slime-train-script" in argv:
        i = argv.index("--slime-train-script")
        if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
            raise LauncherError("--slime-train-script needs a PATH: the train.py of a slime checkout")
        script, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        if not os.path.isfile(script):
            raise LauncherError(f"--slime-train-script {script}: no such file; pass the train.py of a slime checkout")
        # a checkout's train.py imports the slime package that sits beside it
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        import slime
    except ModuleNotFoundError as exc:
        if exc.name != "slime":
            raise LauncherError(f"importing slime failed: no module named {exc.name!r}; install slime's "
                                f"requirements in this environment") from None
        if script:
            raise LauncherError(f"slime is neither installed nor beside {script}: install slime in this "
                                "environment, or point --slime-train-script at a slime checkout's train.py") from None
        raise LauncherError(f"slime is not installed: {INSTALL_REMEDY}") from None
    if script is None:
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(slime.__file__))), "train.py")
        if not os.path.isfile(script):
            raise LauncherError(f"no train.py beside the installed slime package ({script}); "
                                "pass --slime-train-script /path/to/slime/train.py")
    return script, argv


def main(argv: list[str] | None = None) -> None:
    """`python -m safe_ckpt.integrations.slime [--slime-train-script PATH] <train.py arguments>`.

    ``-h``/``--help`` prints the launcher's own help and exits 0, with or without slime; a call
    that cannot start slime prints one line naming the remedy and exits 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(launcher_help(), end="")
        raise SystemExit(0)
    try:
        script, argv = _find_train_script(argv)
        import slime.utils.arguments as slime_arguments
    except LauncherError as exc:
        print(f"{LAUNCHER}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ModuleNotFoundError as exc:
        print(f"{LAUNCHER}: importing slime failed: no module named {exc.name!r}; install slime's requirements "
              "in this environment", file=sys.stderr)
        raise SystemExit(2) from None

    original = slime_arguments.parse_args

    def parse_args(add_custom_arguments=None):
        def both(parser):
            parser = add_custom_arguments(parser) if add_custom_arguments else parser
            return add_arguments(parser)

        return original(add_custom_arguments=both)

    slime_arguments.parse_args = parse_args
    sys.argv = [script, *_launcher_argv(argv)]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
