"""slime's checkpoint load through safe_ckpt: `--ckpt-backend safe` reads the checkpoint too.

One job: in a train actor, rebind the name `_load_checkpoint_megatron` of slime's
`slime.backends.megatron_utils.checkpoint` (bound at import to Megatron's `load_checkpoint`; slime's
own `load_checkpoint` calls it for a Megatron `--load`: the actor's `init` through
`initialize_model_and_optimizer`, `--release-train`'s reload of the last save in every new actor,
`load_other_checkpoint`'s ref/teacher loads) to `safe_ckpt.megatron.load_checkpoint` with the
same arguments. `--safe-ckpt-stock-load` keeps Megatron's own load.

Classes: slime's Megatron patch loads the common state with `weights_only=False` (its args may hold
classes outside megatron-core's safe globals); safe_ckpt's load is `weights_only=True`. The
checkpoint's `args` were written by this same program with the same argument types, so the classes
of the values this process's own args hold are admitted (`classes_in_args`), and nothing else: a
checkpoint holding any other class is refused, naming it, with `--safe-ckpt-stock-load` as the
remedy. An admitted class is one the checkpoint may construct, as with any safe global; classes
themselves, functions, modules and builtins are never admitted from the args.

Must not: break the actor: where the module or the name is missing (another slime version), a
WARNING says so and slime's load stays stock.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import logging

from ..errors import ReadError

log = logging.getLogger("safe_ckpt")

SLIME_CHECKPOINT_MODULE = "slime.backends.megatron_utils.checkpoint"
LOAD_NAME = "_load_checkpoint_megatron"
_REFUSED = "refused: it references"  # safe_ckpt.loading.objects' refusal of an unlisted class


def classes_in_args(args) -> tuple[type, ...]:
    """The classes of the values ``args`` holds (through lists, tuples, dicts, sets and nested
    Namespaces), in first-seen order, less classes as values, functions, modules and builtins."""
    found: dict[int, type] = {}
    seen: set[int] = set()
    stack = [vars(args)]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            for k, v in value.items():
                stack += [v, k]
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += list(value)[::-1]
        elif isinstance(value, argparse.Namespace):
            stack.append(vars(value))
        cls = _admissible_class(value)
        if cls is not None:
            found.setdefault(id(cls), cls)
    return tuple(found.values())


def _admissible_class(value) -> type | None:
    if (isinstance(value, type) or inspect.isroutine(value) or inspect.ismodule(value)
            or isinstance(value, functools.partial)):
        return None
    cls = type(value)
    return None if cls.__module__ == "builtins" else cls


def _routed(args, stock):
    """What slime's `load_checkpoint` calls in place of Megatron's (same arguments)."""

    def load_checkpoint(*a, **kw):
        from ..megatron.loading import load_checkpoint as safe_load_checkpoint
        from ..megatron.loading import load_options_from_args

        options = load_options_from_args(args)
        options = dataclasses.replace(options, safe_globals=(*options.safe_globals, *classes_in_args(args)))
        log.info("slime loads %s through safe_ckpt", getattr(args, "load", None))
        try:
            return safe_load_checkpoint(*a, safe_ckpt_options=options, **kw)
        except ReadError as exc:
            if _REFUSED not in str(exc):
                raise
            raise type(exc)(f"{exc}. With slime, the classes this process's own args hold are admitted already; "
                            f"to load this checkpoint as slime's patched Megatron does (weights_only=False, "
                            f"for a checkpoint you trust), pass --safe-ckpt-stock-load", exc.failures) from None

    load_checkpoint._safe_ckpt_stock = stock
    return load_checkpoint


def install_load(args, checkpoint_module: str | None = None) -> bool:
    """Route slime's Megatron-checkpoint load through safe_ckpt in this process, unless
    `--safe-ckpt-stock-load`; True where it now does. Never raises for another slime version."""
    name = checkpoint_module or getattr(args, "safe_ckpt_checkpoint_module", None) or SLIME_CHECKPOINT_MODULE
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        log.warning("cannot import %s (%s): slime's checkpoint load stays stock Megatron's", name, exc)
        return False
    current = getattr(module, LOAD_NAME, None)
    if current is None:
        log.warning("%s has no %s (another slime version?): slime's checkpoint load stays stock "
                    "Megatron's", name, LOAD_NAME)
        return False
    stock = getattr(current, "_safe_ckpt_stock", current)
    if getattr(args, "safe_ckpt_stock_load", False):
        setattr(module, LOAD_NAME, stock)
        log.info("slime's checkpoint load stays stock Megatron's (--safe-ckpt-stock-load)")
        return False
    try:
        from megatron.training import checkpointing as mck
    except ImportError as exc:
        log.warning("megatron.training is not importable (%s): slime's checkpoint load stays stock", exc)
        return False
    if stock is not getattr(mck, "load_checkpoint", None):
        log.warning("%s.%s is not Megatron's load_checkpoint (%r): slime's checkpoint load stays as it is",
                    name, LOAD_NAME, stock)
        return False
    setattr(module, LOAD_NAME, _routed(args, stock))
    log.info("slime's checkpoint load goes through safe_ckpt (%s.%s); --safe-ckpt-stock-load keeps "
             "Megatron's", name, LOAD_NAME)
    return True
