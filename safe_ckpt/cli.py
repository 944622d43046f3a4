"""The `safe-ckpt` command line: demo and benchmarks (more verbs come with their issues).

One job: parse arguments, set up logging, read environment variables (the edge), and
call the library. Must not: contain save logic.
"""

from __future__ import annotations

import argparse
import logging
import sys


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
