"""GPU tests (marked `gpu`, skipped without CUDA; `bash benchmarks/gpu_suite.sh gputests`)."""
