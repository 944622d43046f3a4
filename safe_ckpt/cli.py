"""The `safe-ckpt` command line: demo, verify, inspect, gc, copy and bench.

One job: parse arguments, set up logging, read environment variables (the edge), and
call the library. Must not: contain save logic.
"""

from __future__ import annotations

import argparse
import logging
import sys


class Bar:
    """A one-line progress bar on stderr (only when it is a terminal)."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        pct = int(100 * done / total)
        if pct != self._last:
            self._last = pct
            filled = pct * 30 // 100
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {pct:3d}% "
                             f"{done / 1e9:.2f}/{total / 1e9:.2f} GB")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _verify(args: argparse.Namespace) -> int:
    import json

    from .tools.verify import verify

    report = verify(args.directory, deep=args.deep, progress=None if args.json else Bar("verify"))
    if args.json:
        print(json.dumps({"directory": report.directory, "ok": report.ok, "items": report.items_checked,
                          "bytes": report.bytes_checked, "checksummed_items": report.checksummed_items,
                          "findings": [f.__dict__ for f in report.findings]}, indent=1))
    else:
        for f in report.findings:
            print(f"{f.severity.upper():7} {f.path}: {f.message}")
        print(f"{'OK' if report.ok else 'FAILED'}: {report.items_checked} items, {report.bytes_checked / 1e9:.3f} GB "
              f"read, {report.checksummed_items} items checked against the manifest")
    return 0 if report.ok else 1


def _inspect(args: argparse.Namespace) -> int:
    import json

    from .tools.inspect import inspect, to_text

    info = inspect(args.directory)
    print(json.dumps(info, indent=1, default=str) if args.json else to_text(info))
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .tools.gc import collect

    found = collect(args.root, dry_run=args.dry_run)
    for path in found:
        print(("would remove " if args.dry_run else "removed ") + path)
    if not found:
        print("nothing to remove")
    return 0


def _copy(args: argparse.Namespace) -> int:
    import json

    from .tools.copy import copy

    report = copy(args.src, args.dst, src_spec=json.loads(args.src_spec) if args.src_spec else None,
                  dst_spec=json.loads(args.dst_spec) if args.dst_spec else None,
                  replace="any" if args.replace else "checkpoint")
    print(f"copied {report.files} files, {report.bytes / 1e9:.3f} GB")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(world_size=args.ranks, size_mb=args.size_mb, out=args.out, keep=args.keep,
                     io_threads=args.io_threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="safe-ckpt", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="save Megatron-shaped state at N ranks, load it with stock Megatron, print GB/s")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size-mb", type=int, default=384, help="total state size across ranks")
    p.add_argument("--out", default=None, help="directory to save into (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint after the demo")
    p.add_argument("--io-threads", type=int, default=4)
    p.set_defaults(func=_demo)

    p = sub.add_parser("verify", help="re-read every item of a checkpoint; check files, structure, checksums")
    p.add_argument("directory")
    p.add_argument("--deep", action="store_true", help="also torch.load every tensor item (slower)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_verify)

    p = sub.add_parser("inspect", help="keys, shapes, dtypes, chunks, bytes per rank and file, iteration")
    p.add_argument("directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("gc", help="remove what interrupted saves left under ROOT (hidden .safe_ckpt-* dirs)")
    p.add_argument("root")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=_gc)

    p = sub.add_parser("copy", help="copy a checkpoint between a directory and a kvstore (file://, gs://, s3://...)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--src-spec", default=None, help="TensorStore kvstore spec (JSON) the SRC path lies in")
    p.add_argument("--dst-spec", default=None, help="TensorStore kvstore spec (JSON) the DST path lies in")
    p.add_argument("--replace", action="store_true", help="overwrite whatever DST holds")
    p.set_defaults(func=_copy)

    p = sub.add_parser("bench", help="benchmark against stock Megatron and DCP (see safe-ckpt bench -h)",
                       add_help=False)
    p.set_defaults(func=None)

    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        from .bench.run import main as bench_main

        logging.basicConfig(level=logging.WARNING)
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
