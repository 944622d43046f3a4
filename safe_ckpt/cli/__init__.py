"""The `safe-ckpt` command line: demo, verify, inspect, gc, copy and bench.

One job: parse arguments, set up logging, read environment variables (the edge), call
the library, and turn every outcome into a message and an exit code: 0 success, 1 a bad
checkpoint or a failed operation, 2 a usage error (bad path, not a directory, a save root
without a tracker, a prefix with no key or a bucket that does not exist, bad argument), 130
interrupted. Messages name command-line flags, never the library's Python options (the
library's remedies are reworded here, `cli_words`), and paths as the user wrote them; long
commands show one progress line on a terminal (`ProgressLine`; -q: none). The grammar is in
`parser`, what each command does in `commands`, the output helpers in `output`, the way to the
lab in `lab`. Must not: contain save logic, or print a traceback unless asked with -v.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from .commands import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, _lab
from .output import cli_words
from .parser import build_parser
from ..write.progress import progress_lines

log = logging.getLogger("safe_ckpt.cli")


def _fail(command: str, message: str) -> None:
    print(f"safe-ckpt {command}: {cli_words(message)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run a parsed command and map its outcome to an exit code."""
    from ..errors import CheckpointError, PathUsageError, TrackerError
    from ..sinks.tensorstore import StoreNotFoundError

    try:
        return args.func(args)
    except BrokenPipeError:  # `safe-ckpt inspect | head`: the reader left; not this command's failure
        raise
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
        # safe_ckpt's own lines (gc's, a save's progress) as `show_progress` prints them
        with progress_lines(level=logging.DEBUG if args.verbose else logging.INFO):
            return run(args)
    except KeyboardInterrupt:  # outside a command's own handling (imports, argument parsing)
        print("safe-ckpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `safe-ckpt inspect | head`: the reader left; say nothing more
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
