"""The `safe-ckpt` command line: demo, verify, inspect, gc, copy and bench.

One job: parse arguments, set up logging, read environment variables (the edge), call
the library, and turn every outcome into a message and an exit code: 0 success, 1 a bad
checkpoint or a failed operation, 2 a usage error (bad path, not a directory, a save root
without a tracker, a prefix with no key or a bucket that does not exist, bad argument), 130
interrupted. Messages name command-line flags, never the library's Python options (the
library's remedies are reworded here, `cli_words`), and paths as the user wrote them; long
commands show one progress line on a terminal (`ProgressLine`; -q: none). Must not: contain
save logic, or print a traceback unless asked with -v.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
import warnings

from .output import ProgressLine, cli_words
from ..write.progress import human_bytes
from ..names import HIDDEN, TRACKER_FILE
from ..version import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

log = logging.getLogger("safe_ckpt.cli")


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


def _located(path: str):
    from ..targets.directory.locate import locate

    located = locate(path)
    if located.note():
        print(located.note(), file=sys.stderr)
    return located


def _kv_located(args: argparse.Namespace, target):
    """A kvstore argument's checkpoint prefix, following a save root's tracker (said on stderr)."""
    from ..tools import kvtools

    located = kvtools.locate(target, args.request_timeout_s)
    if located.note():
        print(located.note(), file=sys.stderr)
    return located


def _kv_target(args: argparse.Namespace, path: str, spec_json: str | None = None, flag: str = "--kvstore-spec"):
    """The kvstore target of a tool argument (None: a local directory); ``flag`` names the
    argument ``spec_json`` came from. The endpoint of an `s3://` URL: --endpoint, else the
    environment's, by the rule every entry point follows (`safe_ckpt.targets.endpoints`)."""
    from ..targets.endpoints import tool_target

    spec = _json_arg(spec_json, flag)
    if spec is not None:
        _check_kv_spec(spec, flag)
    scheme, sep, rest = path.partition("://")
    if sep and scheme in ("s3", "gs") and spec is None and not rest.split("/", 1)[0]:
        raise UsageError(f"{path}: the URL names no bucket ({scheme}://BUCKET/PREFIX)")
    target = tool_target(path, spec, args.endpoint)
    return target if target.is_kvstore else None


def _add_kv_arguments(p: argparse.ArgumentParser, spec: bool = True) -> None:
    if spec:
        p.add_argument("--kvstore-spec", default=None,
                       help="TensorStore kvstore spec (JSON) the path lies in, e.g. an s3 bucket at an endpoint")
    p.add_argument("--endpoint", default=None, help="S3-compatible endpoint for s3:// URLs (MinIO, Ceph RGW); "
                                                    "default AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL")
    p.add_argument("--request-timeout-s", type=_positive(float), default=30.0,
                   help="the most one kvstore request may take, retries included (default 30)")


def _verify(args: argparse.Namespace) -> int:
    import json

    from ..tools import kvtools
    from ..tools.verify import verify

    target = _kv_target(args, args.directory, args.kvstore_spec)
    located = _located(args.directory) if target is None else _kv_located(args, target)
    quiet_megatron_import()
    line = _progress(args, "verify --deep" if args.deep else "verify")
    try:
        report = verify(located.directory, deep=args.deep, progress=line) if target is None else \
            kvtools.verify(located.target, deep=args.deep, progress=line, request_timeout_s=args.request_timeout_s)
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
        checked = (f", {report.checksummed_items} items checked against the manifest" if report.has_manifest else
                   ", checksums unavailable (no safe_ckpt manifest): files, sizes and structure checked"
                   if report.ok else "")
        print(f"{'OK' if report.ok else 'FAILED'}: {report.items_checked} items, {human_bytes(report.bytes_checked)} "
              f"read{checked}" + ("; common state loads (weights only)" if report.common_state_loaded else ""))
        if report.deep:
            print(f"deep: torch.load(weights_only=True) of {report.deep_loaded_items} tensor items, "
                  f"{report.deep_loaded_bytes} bytes of tensor data, each with the dtype and shape the index "
                  f"promises; {report.object_items} object items checked by checksum only (never unpickled)")
    return EXIT_OK if report.ok else EXIT_FAILED


def _inspect(args: argparse.Namespace) -> int:
    import json

    from ..tools import kvtools
    from ..tools.inspect import inspect, to_text

    target = _kv_target(args, args.directory, args.kvstore_spec)
    located = _located(args.directory) if target is None else _kv_located(args, target)
    quiet_megatron_import()
    info = inspect(located.directory) if target is None else kvtools.inspect(located.target, args.request_timeout_s)
    info["followed_tracker"] = located.via_tracker
    print(json.dumps(info, indent=1, default=str) if args.json else to_text(info))
    return EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    from ..targets.directory.gc import collect
    from ..targets.directory.locate import require_directory
    from ..targets.objectstore import gc as kv_gc

    target = _kv_target(args, args.root, args.kvstore_spec)
    quiet_megatron_import()  # reading an index imports megatron-core: its import chatter silenced first
    if target is None:
        found = collect(require_directory(args.root, "save root"), dry_run=args.dry_run,
                        **({"stale_after_s": 0.0} if args.force else {}))
    else:
        found = kv_gc.collect(target, dry_run=args.dry_run, request_timeout_s=args.request_timeout_s,
                              force=args.force)
    for path in found:
        print(("would remove " if args.dry_run else "removed ") + path)
    if not found:
        print("nothing to remove")
    return EXIT_OK


def _check_kv_spec(spec, flag: str) -> None:
    """A spec TensorStore cannot parse is the caller's mistake (exit 2), not a failed command."""
    if not isinstance(spec, dict):
        raise UsageError(f"{flag} must be a JSON object (a TensorStore kvstore spec), got {type(spec).__name__}")
    import tensorstore as ts

    try:
        ts.KvStore.Spec(spec)
    except Exception as exc:
        raise UsageError(f"{flag} is not a TensorStore kvstore spec: {exc}") from None


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _json_arg(text: str | None, name: str):
    import json

    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{name} is not valid JSON: {exc}") from None


def _copy(args: argparse.Namespace) -> int:
    import os

    from ..tools.copy import copy
    from ..targets.directory.locate import require_directory

    src = _kv_target(args, args.src, args.src_spec, "--src-spec")
    dst = _kv_target(args, args.dst, args.dst_spec, "--dst-spec")
    if src is None:
        require_directory(args.src, "source directory")
        located = _located(args.src)
        src_path, src_spec = located.shown, None
    else:
        located = _kv_located(args, src).target
        src_path, src_spec = located.path, located.spec
    if dst is None and os.path.exists(args.dst) and not os.path.isdir(args.dst):
        raise UsageError(f"{args.dst}: not a directory")
    quiet_megatron_import()  # replacing a checkpoint reads its index, which imports megatron-core
    line = _progress(args, "copy")
    try:
        report = copy(src_path, dst.path if dst else args.dst, src_spec=src_spec, dst_spec=dst.spec if dst else None,
                      replace="any" if args.replace else "checkpoint", request_timeout_s=args.request_timeout_s,
                      progress=line)
    finally:
        line.close()
    print(f"copied {report.source} to {report.destination}: {report.files} files, {human_bytes(report.bytes)}")
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


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's -v / -q must not reset the one given before the subcommand
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging, and the traceback of an unexpected error")
    parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress line")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="save Megatron-shaped state at N ranks, load it back with stock Megatron, "
                                           "compare with the write ceiling and stock DCP")
    p.add_argument("--ranks", type=_positive(int), default=2, help="number of ranks (processes) to save from (default: 2)")
    p.add_argument("--size-mb", type=_positive(int), default=384, help="total state size across ranks, in MiB (default: 384)")
    p.add_argument("--out", default=None, help="directory to save into (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint after the demo")
    p.add_argument("--io-threads", type=_positive(int), default=4, help="writer threads per rank (default: 4)")
    p.set_defaults(func=_demo)


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="re-read every item of a checkpoint; check files, structure, checksums",
                       description="Re-read every item of a torch_dist checkpoint and check it against the index "
                                   "and the manifest (a plain DCP checkpoint: all but checksums). Never runs code "
                                   "from the checkpoint. Exit code 0: OK, 1: the checkpoint has errors, 2: bad "
                                   "path.")
    p.add_argument("directory", help="a checkpoint directory (iter_NNNNNNN), or a save root holding "
                                     f"{TRACKER_FILE} (the tracker is followed)")
    p.add_argument("--deep", action="store_true",
                   help="also torch.load(weights_only=True) every tensor item and check its dtype and shape (slower)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_kv_arguments(p)
    p.set_defaults(func=_verify)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="keys, shapes, dtypes, chunks, bytes per rank and file, iteration",
                       description="Summarise what a torch_dist checkpoint holds. Never runs code from the "
                                   "checkpoint. Exit code 0: shown, 1: unreadable checkpoint, 2: bad path.")
    p.add_argument("directory", help="a checkpoint directory (iter_NNNNNNN), or a save root holding "
                                     f"{TRACKER_FILE} (the tracker is followed)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_kv_arguments(p)
    p.set_defaults(func=_inspect)


def _add_gc(sub) -> None:
    p = sub.add_parser("gc", help=f"remove what interrupted saves left under ROOT (hidden {HIDDEN}* dirs)")
    p.add_argument("root", help="the save root (the directory holding the iter_* checkpoints)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--force", action="store_true",
                   help="no save of ROOT is running: take every owner record or owner object as stale, however "
                        "recent its heartbeat (a local save still holding its lock is left alone)")
    _add_kv_arguments(p)
    p.set_defaults(func=_gc)


def _add_copy(sub) -> None:
    p = sub.add_parser("copy", help="copy a checkpoint between a directory and a kvstore (file://, gs://, s3://...)",
                       description="Copy a complete checkpoint; DST becomes a checkpoint only once it is whole (a "
                                   "local DST in one rename, as a save publishes). DST may be empty, missing or "
                                   "a checkpoint (which is replaced); anything else needs --replace. Exit code 0: "
                                   "copied, 1: failed (a local DST is left as it was; on an object store DST "
                                   "then holds no checkpoint), 2: bad path.")
    p.add_argument("src", help="the checkpoint to copy: a directory or a kvstore URL, or a save root holding "
                               f"{TRACKER_FILE} (the tracker is followed)")
    p.add_argument("dst", help="where to copy it: a directory or a kvstore URL")
    p.add_argument("--src-spec", default=None, help="TensorStore kvstore spec (JSON) the SRC path lies in")
    p.add_argument("--dst-spec", default=None, help="TensorStore kvstore spec (JSON) the DST path lies in")
    p.add_argument("--replace", action="store_true",
                   help="replace whatever DST holds: afterwards it holds exactly the copied checkpoint (its "
                        "other files are removed; a save running into DST is still refused)")
    _add_kv_arguments(p, spec=False)
    p.set_defaults(func=_copy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safe-ckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"safe-ckpt {__version__}",
                        help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and the traceback of an "
                                                                     "unexpected error")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_verify, _add_inspect, _add_gc, _add_copy):
        add(sub)
    for p in sub.choices.values():
        _add_verbose(p)
    p = sub.add_parser("bench", help="benchmark against stock Megatron and DCP (see safe-ckpt bench -h)",
                       add_help=False)
    p.set_defaults(func=None)
    return parser


def _fail(command: str, message: str) -> None:
    print(f"safe-ckpt {command}: {cli_words(message)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run a parsed command and map its outcome to an exit code."""
    from ..errors import CheckpointError, PathUsageError, TrackerError
    from ..sinks.tensorstore import StoreNotFoundError

    try:
        return args.func(args)
    except KeyboardInterrupt:
        _fail(args.command, "interrupted")
        return EXIT_INTERRUPTED
    except (UsageError, PathUsageError, StoreNotFoundError) as exc:  # a missing bucket is a missing path
        _fail(args.command, f"error: {exc}")
        return EXIT_USAGE
    except (CheckpointError, TrackerError) as exc:
        _fail(args.command, str(exc))
        if args.verbose:
            traceback.print_exc()
        return EXIT_FAILED
    except Exception as exc:
        _fail(args.command, f"failed: {type(exc).__name__}: {exc}"
              + ("" if args.verbose else " (run with -v for the traceback)"))
        if args.verbose:
            traceback.print_exc()
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    try:
        if argv[:1] == ["bench"]:
            try:
                bench = _lab("bench.main", "bench")
            except UsageError as exc:
                _fail("bench", f"error: {exc}")
                return EXIT_USAGE
            logging.basicConfig(level=logging.WARNING)
            return bench.main(argv[1:])
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(message)s")
        return run(args)
    except KeyboardInterrupt:  # outside a command's own handling (imports, argument parsing)
        print("safe-ckpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
