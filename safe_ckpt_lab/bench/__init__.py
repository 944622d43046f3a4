"""Benchmark harness: safe_ckpt beside stock Megatron and DCP on the same state, beside the
machine's ceilings, all in one run. `python -m safe_ckpt_lab.bench --help` or `safe-ckpt bench`.

Modules: `state` (presets and residence mixes), `peers` (one runner per saver),
`ceilings` (D2H, parallel write, memcpy), `collective` (those ceilings on every rank at
once), `node` (per-rank parts of N ranks on one host), `measure` (RSS, pinned allocations,
H2D count), `report` (JSON, Markdown, PNG), `goals` (per-rank figures and the goals of a
run), `run` (the loop and medians).
"""
