"""The benchmark's command line: its arguments, their checks and defaults.

One job: turn ``safe-ckpt bench`` / ``python -m safe_ckpt_lab.bench`` arguments into the
namespace `run.run` reads, refusing a wrong one with argparse's usage error before anything
runs. Must not: run, launch or report anything.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

from . import peers
from .machine import fs_type

DESCRIPTION = ("Benchmark safe_ckpt beside stock Megatron and stock DCP saving the same state, and beside the "
               "machine's write and copy ceilings measured in the same run; writes PREFIX.json, PREFIX.md and, "
               "with matplotlib installed, a chart PREFIX.png.")


def _resolves(peer: str) -> bool:
    try:
        peers.resolve(peer)
    except ValueError:
        return False
    return True



def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="safe-ckpt bench", description=DESCRIPTION)
    ap.add_argument("--preset", default="anchor", choices=["anchor", "qwen3-4b-dp8"],
                    help="state shape and rank count to benchmark (default: anchor)")
    ap.add_argument("--gib", type=float, default=None, help="state size per rank (default: the preset's)")
    ap.add_argument("--residences", default="gpu", help="comma list of gpu, opt-pinned, opt-pageable")
    ap.add_argument("--targets", default="/dev/shm/safe_ckpt_bench",
                    help="comma list of directories to save into (default: /dev/shm/safe_ckpt_bench)")
    ap.add_argument("--peers", default="all",
                    help=f"comma list of {', '.join(peers.PEERS + peers.EXTRA_PEERS)} (all: the first {len(peers.PEERS)}); "
                         "NAME@T: that saver with T writer threads")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each saver (default: 3)")
    ap.add_argument("--peer-reps", type=int, default=None, help="runs of the stock peers (default: --reps)")
    ap.add_argument("--cache", default="cold", help="cold, warm or cold,warm (pinned host cache)")
    ap.add_argument("--peer-cache", default=None, help="cache modes for the stock peers (default: --cache)")
    ap.add_argument("--threads", type=int, default=8,
                    help="writer threads per rank of every saver and the ceiling (default: 8); 0: the safe_ckpt "
                         "peers on the library's per-host defaults (writers, pool unless --budget-gib, hashing "
                         "threads), every other saver and the ceiling on cores / ranks of the host")
    ap.add_argument("--ceiling-reps", type=int, default=3,
                    help="runs of the write ceiling at each thread count, the best counting (default: 3)")
    ap.add_argument("--budget-gib", type=float, default=None, help="safe_ckpt staging budget")
    ap.add_argument("--count-h2d", action="store_true", help="count memcpy events per peer with the profiler")
    ap.add_argument("--ceiling-each-rep", action="store_true",
                    help="also measure the write ceiling once per round of runs (reports its median beside the best)")
    ap.add_argument("--ceiling-beside-d2h", nargs="?", const="all", default=None, metavar="FSTYPE",
                    help="also measure the write ceiling with the state's GPU bytes copied device-to-host beside it; "
                         "with FSTYPE (e.g. tmpfs) only on targets of that filesystem (a disk's write, not the "
                         "copies, sets its bound, so this saves a disk-sized write per repetition there)")
    ap.add_argument("--verify", default="safe_sync,safe_async",
                    help="after each target's timed runs, one more save by each of these safe_ckpt peers, loaded "
                         "back with stock Megatron and compared bit for bit on every rank; a mismatch fails the "
                         "run after its report is written ('none': skip)")
    ap.add_argument("--label", default=None, help="a name for this run in its report")
    ap.add_argument("--out", default=None, help="output prefix (writes .json, .md, and .png with matplotlib)")
    ap.add_argument("--rebuild", metavar="PREFIX", default=None,
                    help="only write the report of an earlier run from PREFIX.meta.json and PREFIX.rows.jsonl")
    ap.add_argument("--ray-actors", type=int, default=0,
                    help="run as N Ray actors (one per GPU), as slime launches training, instead of in-process")
    args = ap.parse_args(argv)
    if args.threads < 0 or args.ceiling_reps < 1:
        ap.error("--threads must be 0 (library defaults) or more, --ceiling-reps 1 or more")
    on = sorted({fs_type(t.rstrip("/")) for t in args.targets.split(",")})
    if args.ceiling_beside_d2h not in (None, "all", *on):  # a typo would measure nothing, silently
        ap.error(f"--ceiling-beside-d2h {args.ceiling_beside_d2h}: no target is on it; the targets are on "
                 f"{', '.join(on)} (name one, or give the flag alone for every target)")
    if args.rebuild:
        return args  # only the report of an earlier run: nothing else is read
    chosen = peers.PEERS if args.peers == "all" else tuple(args.peers.split(","))
    for peer in chosen:
        try:
            peers.resolve(peer)
        except ValueError as exc:
            ap.error(f"--peers: {exc}")
    args.verify = [] if args.verify == "none" else [p for p in args.verify.split(",") if p]
    wrong = [p for p in args.verify if not p.startswith("safe") or not _resolves(p)]
    if wrong:
        ap.error(f"--verify takes safe_ckpt peers ({', '.join(p for p in peers.RUNNERS if p.startswith('safe'))}) "
                 f"or 'none', not {', '.join(wrong)}")
    unused = [p for p in args.verify if p not in chosen]
    if unused and "--verify" in (argv if argv is not None else sys.argv[1:]):
        print(f"safe-ckpt bench: --verify {', '.join(unused)}: not among --peers, not verified", file=sys.stderr)
    unchecked = [p for p in chosen if p.startswith("safe") and "@" in p and p not in args.verify]
    if unchecked:
        print(f"safe-ckpt bench: {', '.join(unchecked)}: not loaded back (name it in --verify to check it)",
              file=sys.stderr)
    args.peer_reps = args.reps if args.peer_reps is None else args.peer_reps
    args.peer_cache = args.peer_cache or args.cache
    args.label = args.label or f"safe_ckpt bench {datetime.date.today().isoformat()}"
    args.out = os.path.abspath(args.out or f"benchmarks/results/bench_{socket.gethostname()}_{int(time.time())}")
    return args
