"""Long randomized runs (marked `soak`; `pytest --soak`, or `bash scripts/soak.sh`)."""
