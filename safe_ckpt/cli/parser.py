"""The command line's grammar: every command, argument, default and help text.

One job: build the `safe-ckpt` argument parser, each command bound to its function in
`commands`; `bench` is only named here (its own parser is the lab's). Must not: run anything.
"""

from __future__ import annotations

import argparse

from ..names import HIDDEN, TRACKER_FILE
from ..version import __version__
from .commands import _copy, _demo, _gc, _inspect, _verify

DESCRIPTION = "The `safe-ckpt` command line: demo, verify, inspect, gc, copy and bench."


def _add_store_arguments(p: argparse.ArgumentParser, spec: bool = True) -> None:
    if spec:
        p.add_argument("--kvstore-spec", dest="store_spec", default=None,
                       help="TensorStore kvstore spec (JSON) the path lies in, e.g. an s3 bucket at an endpoint")
    p.add_argument("--endpoint", default=None, help="S3-compatible endpoint for s3:// URLs (MinIO, Ceph RGW); "
                                                    "default AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL")
    p.add_argument("--request-timeout-s", type=_positive(float), default=30.0,
                   help="the most one kvstore request may take, retries included (default 30)")


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
    _add_store_arguments(p)
    p.set_defaults(func=_verify)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="keys, shapes, dtypes, chunks, bytes per rank and file, iteration",
                       description="Summarise what a torch_dist checkpoint holds. Never runs code from the "
                                   "checkpoint. Exit code 0: shown, 1: unreadable checkpoint, 2: bad path.")
    p.add_argument("directory", help="a checkpoint directory (iter_NNNNNNN), or a save root holding "
                                     f"{TRACKER_FILE} (the tracker is followed)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_store_arguments(p)
    p.set_defaults(func=_inspect)


def _add_gc(sub) -> None:
    p = sub.add_parser("gc", help=f"remove what interrupted saves left under ROOT (hidden dirs whose names hold {HIDDEN}, "
                       f"e.g. .iter_0000005{HIDDEN}staging-ID)")
    p.add_argument("root", help="the save root (the directory holding the iter_* checkpoints)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--force", action="store_true",
                   help="no save of ROOT is running: take every owner record or owner object as stale, however "
                        "recent its heartbeat (a local save still holding its lock is left alone)")
    _add_store_arguments(p)
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
    _add_store_arguments(p, spec=False)
    p.set_defaults(func=_copy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safe-ckpt", description=DESCRIPTION)
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
