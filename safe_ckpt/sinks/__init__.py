"""Bytes at offsets of named files, durably: the interface (`base`), POSIX files (`posix`),
TensorStore kvstore values (`tensorstore`), and injected faults for tests (`faults`).
Must not: know about tensors, plans or what makes a checkpoint (`targets` does).
"""
