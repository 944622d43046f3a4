"""The lab (`safe_ckpt_lab`): the benchmark harness, the demo, the diagnostics' helpers."""
