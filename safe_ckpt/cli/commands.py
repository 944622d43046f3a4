"""The command line's commands: what `verify`, `inspect`, `gc`, `copy` and `demo` do with
parsed arguments, and the usage errors (exit 2) they raise.

One job: turn a parsed command into library calls and printed results: follow a save root's
tracker (said on stderr), pick the kvstore target of an argument (the endpoint rule of
`targets.endpoints`), refuse an argument no command can work with (`UsageError`), and run the
lab's demo through `lab`. Must not: parse arguments or decide exit codes for errors (`run` does).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from ..units import counted, human_bytes
from .output import ProgressLine

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ValueError):
    """An argument the command cannot work with (exit code 2)."""


def _progress(args: argparse.Namespace, label: str) -> ProgressLine:
    return ProgressLine(label, enabled=False if getattr(args, "quiet", False) or getattr(args, "json", False)
                        else None)


def quiet_megatron_import() -> None:
    """Import megatron-core once with its import-time chatter (Transformer Engine / Apex
    fallback warnings, Megatron-FSDP INFO lines) silenced; the read-only tools need it only
    for the classes its common state may hold."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.INFO)
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            pass
        finally:
            logging.disable(previous)


def _followed(target):
    """The checkpoint a tool argument means, following a save root's tracker (said on stderr)."""
    followed = target.follow_tracker()
    if followed.note():
        print(followed.note(), file=sys.stderr)
    return followed


def _location(args: argparse.Namespace, path: str, spec_json: str | None = None, flag: str = "--kvstore-spec"):
    """Where a tool argument points, as TensorStore is given it (a path, inside a store spec
    where given); ``flag`` names the argument ``spec_json`` came from. The endpoint of an `s3://`
    URL: --endpoint, else the environment's, by the rule every entry point follows
    (`safe_ckpt.targets.endpoints`)."""
    from ..targets.endpoints import tool_target

    spec = _json_arg(spec_json, flag)
    if spec is not None:
        _check_store_spec(spec, flag)
    scheme, sep, rest = path.partition("://")
    if sep and scheme in ("s3", "gs") and spec is None and not rest.split("/", 1)[0]:
        raise UsageError(f"{path}: the URL names no bucket ({scheme}://BUCKET/PREFIX)")
    return tool_target(path, spec, args.endpoint)


def _target(args: argparse.Namespace, path: str, spec_json: str | None = None, flag: str = "--kvstore-spec"):
    """The `Target` a tool argument names (`targets.resolve`), with the command's request timeout."""
    from ..targets import TargetSettings, resolve

    location = _location(args, path, spec_json, flag)
    return resolve(location.path, spec=location.spec,
                   settings=TargetSettings(request_timeout_s=args.request_timeout_s))


def _verify(args: argparse.Namespace) -> int:
    import json

    from ..tools import on_target

    located = _followed(_target(args, args.directory, args.store_spec))
    quiet_megatron_import()
    line = _progress(args, "verify --deep" if args.deep else "verify")
    try:
        report = on_target.verify(located, deep=args.deep, progress=line)
    finally:
        line.close()
    if args.json:
        print(json.dumps({"directory": report.directory, "followed_tracker": located.via_tracker,
                          "ok": report.ok,
                          "items": report.items_checked, "bytes": report.bytes_checked,
                          "checksummed_items": report.checksummed_items, "object_items": report.object_items,
                          "checksums_available": report.has_manifest, "plain_dcp": report.plain_dcp,
                          "common_state_loaded": report.common_state_loaded, "deep": report.deep,
                          "deep_loaded_items": report.deep_loaded_items,
                          "deep_loaded_bytes": report.deep_loaded_bytes,
                          "findings": [f.__dict__ for f in report.findings]}, indent=1))
    else:
        print(f"checkpoint {report.directory}")
        for f in report.findings:
            print(f"{f.severity.upper():7} {f.path}: {f.message}")
        checked = (f", {counted(report.checksummed_items, 'item')} checked against the manifest" if report.has_manifest else
                   ", checksums unavailable (no safe_ckpt manifest): files, sizes and structure checked"
                   if report.ok else "")
        print(f"{'OK' if report.ok else 'FAILED'}: {counted(report.items_checked, 'item')}, {human_bytes(report.bytes_checked)} "
              f"read{checked}" + ("; common state loads (weights only)" if report.common_state_loaded else ""))
        if report.deep:
            print(f"deep: torch.load(weights_only=True) of {counted(report.deep_loaded_items, 'tensor item')}, "
                  f"{report.deep_loaded_bytes} bytes of tensor data, each with the dtype and shape the index "
                  f"promises; {counted(report.object_items, 'object item')} checked by checksum only (never unpickled)")
    return EXIT_OK if report.ok else EXIT_FAILED


def _inspect(args: argparse.Namespace) -> int:
    import json

    from ..tools import on_target
    from ..tools.inspect import to_text

    located = _followed(_target(args, args.directory, args.store_spec))
    quiet_megatron_import()
    info = on_target.inspect(located)
    print(json.dumps(info, indent=1, default=str) if args.json else to_text(info))
    return EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    target = _target(args, args.root, args.store_spec)
    quiet_megatron_import()  # reading an index imports megatron-core: its import chatter silenced first
    found = target.collect_leftovers(args.dry_run, force=args.force)
    for path in found:
        print(("would remove " if args.dry_run else "removed ") + path)
    if not found:
        print("nothing to remove")
    return EXIT_OK


def _check_store_spec(spec, flag: str) -> None:
    """A spec TensorStore cannot parse is the caller's mistake (exit 2), not a failed command."""
    if not isinstance(spec, dict):
        raise UsageError(f"{flag} must be a JSON object (a TensorStore kvstore spec), got {type(spec).__name__}")
    import tensorstore as ts

    try:
        ts.KvStore.Spec(spec)
    except Exception as exc:
        raise UsageError(f"{flag} is not a TensorStore kvstore spec: {exc}") from None


def _json_arg(text: str | None, name: str):
    import json

    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{name} is not valid JSON: {exc}") from None


def _copy(args: argparse.Namespace) -> int:
    from ..tools.copy import copy

    src = _target(args, args.src, args.src_spec, "--src-spec")
    dst = _target(args, args.dst, args.dst_spec, "--dst-spec")
    src.require_exists("source directory")
    located = _followed(src).target.location
    if not dst.can_hold_a_checkpoint():
        raise UsageError(f"{args.dst}: not a directory")
    quiet_megatron_import()  # replacing a checkpoint reads its index, which imports megatron-core
    line = _progress(args, "copy")
    try:
        report = copy(located.path, dst.location.path, src_spec=located.spec, dst_spec=dst.location.spec,
                      replace="any" if args.replace else "checkpoint", request_timeout_s=args.request_timeout_s,
                      progress=line)
    finally:
        line.close()
    print(f"copied {report.source} to {report.destination}: {counted(report.files, 'file')}, {human_bytes(report.bytes)}")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    import os

    demo = _lab("demo", "demo")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: not a directory")

    return demo.main(world_size=args.ranks, size_mb=args.size_mb, out=args.out, keep=args.keep,
                     io_threads=args.io_threads)


def _lab(module: str, command: str):
    from .lab import LabMissing, lab_module

    try:
        return lab_module(module, command)
    except LabMissing as exc:
        raise UsageError(str(exc)) from None
