"""Where each source tensor lives: GPU memory, a GPU range paused by torch_memory_saver (read
from its CPU backup), pinned or pageable host memory (`classify`), and the few CUDA driver
calls that tell and copy from it (`cuda_driver`). Must not: copy or write anything.
"""
