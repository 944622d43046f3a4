"""The copy window's CUDA streams call the CUDA driver's copy with the arguments it takes (a
mismatch surfaces only on a GPU, as a TypeError in the middle of a save): checked here on the CPU
against the driver module's own signature, the device side stood in."""

import inspect
from types import SimpleNamespace

import torch

from safe_ckpt import cuda_driver
from safe_ckpt.staging.streams import CudaStreams


def test_a_contiguous_copy_goes_to_the_driver_with_arguments_it_accepts(monkeypatch):
    signature = inspect.signature(cuda_driver.memcpy_dtoh_async)
    calls = []
    monkeypatch.setattr(cuda_driver, "memcpy_dtoh_async", lambda *a, **k: calls.append(signature.bind(*a, **k)))
    monkeypatch.setattr(cuda_driver, "current_device", lambda: 0)
    for page_locked in (True, False):
        streams = CudaStreams(page_locked=page_locked, driver_copies=True)
        streams._streams[0] = SimpleNamespace(cuda_stream=1234)  # the device's side stream, stood in
        src, dst = torch.randn(64, generator=torch.Generator().manual_seed(3)), torch.empty(64)
        streams.copy(0, dst, src)
    assert len(calls) == 2
    for bound in calls:
        assert bound.arguments["nbytes"] == 64 * 4 and bound.arguments["stream_handle"] == 1234
