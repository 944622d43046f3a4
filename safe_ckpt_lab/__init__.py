"""The lab: the benchmark harness (`bench/`), the demo (`demo`) and seeded, Megatron-shaped
synthetic state (`synthetic`), kept in the repository beside the library.

One job: measure and show safe_ckpt; tests and benchmarks build their state from here.
Imports safe_ckpt; safe_ckpt never imports it (`scripts/check_layout.py`): the command line
reaches `safe-ckpt demo` and `safe-ckpt bench` through one helper (`safe_ckpt.cli.lab`).
"""
