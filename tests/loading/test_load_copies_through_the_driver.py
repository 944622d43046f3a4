"""A reader thread's copies out of a pinned piece into GPU destinations go through the CUDA
driver as one call per byte range, from two addresses: the ranges land where the torch path puts
them, one event per device marks them for the piece's reuse, and with several devices on one
thread (one current context at a time) the thread copies through torch.

No GPU here: a stand-in takes libcuda's copy call (`cuMemcpyHtoDAsync_v2`'s arguments: device
address, host address, bytes, stream) and does a host memmove, the destinations are host tensors
the thread is told live on a CUDA device, and events are recorded objects. The real driver runs
in tests/gpu/test_load_into_gpu.py (both ways)."""

import ctypes
import types

import pytest
import torch

from safe_ckpt.loading import copies
from safe_ckpt import cuda_driver


class _Event:
    def __init__(self):
        self.recorded = []

    def record(self, stream):
        self.recorded.append(stream)


class _Stream:
    cuda_stream = 0x5EED


def _copier(monkeypatch, destinations, driver_copies=True):
    calls = []

    def htod(dst, src, nbytes, stream):
        assert stream == _Stream.cuda_stream
        calls.append((dst, src, nbytes))
        ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(cuda_driver, "memcpy_htod_async", htod)
    monkeypatch.setattr(cuda_driver, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    plan = types.SimpleNamespace(destinations=[types.SimpleNamespace(flat_bytes=d) for d in destinations])
    reader = types.SimpleNamespace(plan=plan, driver_copies=driver_copies)
    copier = copies.Copier(reader)
    cuda0 = torch.device("cuda", 0)
    copier.streams = {cuda0: _Stream()}  # the thread's stream, made current on its first use
    copier.targets = {i: (d, cuda0, d.data_ptr()) for i, d in enumerate(destinations)}
    return copier, calls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_byte_ranges_land_where_the_torch_path_puts_them(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    piece = torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=g)
    dests = [torch.zeros(n, dtype=torch.uint8) for n in torch.randint(100, 20000, (5,), generator=g).tolist()]
    spans, at = [], 0
    for i, d in enumerate(dests):  # a range into the middle of each destination, back to back in the piece
        start = int(torch.randint(0, d.numel() // 2, (1,), generator=g))
        n = int(torch.randint(1, d.numel() - start + 1, (1,), generator=g))
        spans.append(copies.Span(i, start, at, n))
        at += n + 17  # archive bytes between payloads
    expected = [d.clone() for d in dests]
    for s in spans:
        expected[s.dest][s.dest_start:s.dest_start + s.nbytes] = piece[s.src_start:s.src_start + s.nbytes]
    copier, calls = _copier(monkeypatch, dests)
    copier.addresses = [0, piece.data_ptr()]  # the thread's two pieces: this one is slot 1
    copier.copy_spans(spans, 1, piece)
    assert len(calls) == len(spans)  # one driver call a range, no torch copies
    for d, e in zip(dests, expected):
        assert torch.equal(d, e)
    (event,) = copier.pending[1]  # one event for the device, recorded on the thread's stream after them
    assert event.recorded == [copier.streams[torch.device("cuda", 0)]] and copier.pending[0] == []
    assert copier.copy_s > 0


def test_a_thread_whose_context_is_another_device_copies_through_torch(monkeypatch):
    dests = [torch.zeros(100, dtype=torch.uint8)]
    copier, calls = _copier(monkeypatch, dests)
    monkeypatch.setattr(cuda_driver, "current_device", lambda: 3)
    torch_copies = []
    monkeypatch.setattr(copies.Copier, "_copy_all",
                        lambda self, pairs, slot, devices=None: torch_copies.extend(pairs))
    piece = torch.ones(64, dtype=torch.uint8)
    copier.addresses = [piece.data_ptr(), 0]
    copier.copy_spans([copies.Span(0, 10, 0, 50)], 0, piece)
    assert calls == [] and len(torch_copies) == 1 and torch_copies[0][0].numel() == 50
    assert copier.driver == {torch.device("cuda", 0): False}
