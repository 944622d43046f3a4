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


def _kv_target(args: argparse.Namespace, path: str, spec_json: str | None = None):
    """The kvstore target of a tool argument (None: a local directory). The endpoint of an
    `s3://` URL: --endpoint, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (as boto3 reads them)."""
    import json
    import os

    from .tools.kvtools import endpoint_from, kv_target, region_from

    spec = json.loads(spec_json) if spec_json else None
    return kv_target(path, spec, args.endpoint or endpoint_from(os.environ), region_from(os.environ))


def _add_kv_arguments(p: argparse.ArgumentParser, spec: bool = True) -> None:
    if spec:
        p.add_argument("--kvstore-spec", default=None,
                       help="TensorStore kvstore spec (JSON) the path lies in, e.g. an s3 bucket at an endpoint")
    p.add_argument("--endpoint", default=None, help="S3-compatible endpoint for s3:// URLs (MinIO, Ceph RGW); "
                                                    "default AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL")
    p.add_argument("--request-timeout-s", type=float, default=30.0,
                   help="the most one kvstore request may take, retries included (default 30)")


def _verify(args: argparse.Namespace) -> int:
    import json

    from .tools import kvtools
    from .tools.verify import verify

    target = _kv_target(args, args.directory, args.kvstore_spec)
    bar = None if args.json else Bar("verify")
    report = verify(args.directory, deep=args.deep, progress=bar) if target is None else \
        kvtools.verify(target, deep=args.deep, progress=bar, request_timeout_s=args.request_timeout_s)
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

    from .tools import kvtools
    from .tools.inspect import inspect, to_text

    target = _kv_target(args, args.directory, args.kvstore_spec)
    info = inspect(args.directory) if target is None else kvtools.inspect(target, args.request_timeout_s)
    print(json.dumps(info, indent=1, default=str) if args.json else to_text(info))
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .tools import kvtools
    from .tools.gc import collect

    target = _kv_target(args, args.root, args.kvstore_spec)
    found = collect(args.root, dry_run=args.dry_run) if target is None else \
        kvtools.collect(target, dry_run=args.dry_run, request_timeout_s=args.request_timeout_s)
    for path in found:
        print(("would remove " if args.dry_run else "removed ") + path)
    if not found:
        print("nothing to remove")
    return 0


def _copy(args: argparse.Namespace) -> int:
    import json

    from .tools.copy import copy

    src = _kv_target(args, args.src, args.src_spec)
    dst = _kv_target(args, args.dst, args.dst_spec)
    report = copy(src.path if src else args.src, dst.path if dst else args.dst,
                  src_spec=src.spec if src else None, dst_spec=dst.spec if dst else None,
                  replace="any" if args.replace else "checkpoint", request_timeout_s=args.request_timeout_s)
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
    _add_kv_arguments(p)
    p.set_defaults(func=_verify)

    p = sub.add_parser("inspect", help="keys, shapes, dtypes, chunks, bytes per rank and file, iteration")
    p.add_argument("directory")
    p.add_argument("--json", action="store_true")
    _add_kv_arguments(p)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("gc", help="remove what interrupted saves left under ROOT (hidden .safe_ckpt-* dirs)")
    p.add_argument("root")
    p.add_argument("--dry-run", action="store_true")
    _add_kv_arguments(p)
    p.set_defaults(func=_gc)

    p = sub.add_parser("copy", help="copy a checkpoint between a directory and a kvstore (file://, gs://, s3://...)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--src-spec", default=None, help="TensorStore kvstore spec (JSON) the SRC path lies in")
    p.add_argument("--dst-spec", default=None, help="TensorStore kvstore spec (JSON) the DST path lies in")
    p.add_argument("--replace", action="store_true", help="overwrite whatever DST holds")
    _add_kv_arguments(p, spec=False)
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
