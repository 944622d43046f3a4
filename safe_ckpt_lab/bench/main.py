"""`safe-ckpt bench` / `python -m safe_ckpt_lab.bench`: parse, then report, launch or run.

One job: route a parsed command: `--rebuild` to the report of an earlier run, `--ray-actors N`
to N Ray actors each running this process's part (`ray_launch`), anything else to this
process's part (`run.run_here`: alone, or one rank under torchrun). Must not: measure anything.
"""

from __future__ import annotations

import os
import sys

from . import args as bench_args
from . import ray_launch, run


def main(argv=None) -> int:
    args = bench_args.parse(argv)
    if args.rebuild:
        print(run.rebuild(os.path.abspath(args.rebuild)))
        return 0
    if args.ray_actors:
        rest = list(argv if argv is not None else sys.argv[1:])
        i = rest.index("--ray-actors")
        ray_launch.launch(args.ray_actors, rest[:i] + rest[i + 2:] + ["--out", args.out, "--label", args.label])
        return 0
    return run.run_here(args)
