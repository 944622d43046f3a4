"""Benchmark harness: safe_ckpt beside stock Megatron and DCP on the same state, beside the
machine's ceilings, all in one run. `python -m safe_ckpt.bench --help` or `safe-ckpt bench`.

Modules: `state` (presets and residence mixes), `peers` (one runner per saver),
`ceilings` (D2H, parallel write, memcpy), `measure` (RSS, pinned allocations, H2D
count), `report` (JSON, Markdown, PNG), `run` (the loop and medians).
"""
