"""`python -m safe_ckpt.bench`: the benchmark's former entry point, kept for commands written
before the harness moved to the lab; the same as `safe-ckpt bench` and `python -m safe_ckpt_lab.bench`.

One job: hand the arguments to the command line's `bench`. Must not: import the lab itself
(the command line reaches it through `cli.lab`).
"""

import sys

if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
