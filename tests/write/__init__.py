"""One rank's writers: dispatch, thread priority, the CUDA driver calls, the sink contract."""
