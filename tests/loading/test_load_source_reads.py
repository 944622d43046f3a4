"""`DirectorySource.readv`: one positioned call fills every buffer in the common case; a call the
kernel cuts short continues where it stopped (inside a buffer, or at a buffer's end), and a file
that ends before the last wanted byte is an error naming the file, the offset and the bytes there."""

import os

import pytest
import torch

from safe_ckpt.errors import ReadError
from safe_ckpt.loading import source as source_mod
from safe_ckpt.loading.source import DirectorySource


@pytest.fixture()
def data_file(tmp_path):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=g).numpy().tobytes()
    (tmp_path / "__0_0.distcp").write_bytes(data)
    return DirectorySource(str(tmp_path)), data


def _buffers(sizes):
    bufs = [bytearray(n) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


@pytest.mark.parametrize("cap", [None, 1000, 2048, 4093])
def test_buffers_are_filled_with_the_bytes_at_the_offset_however_the_reads_are_cut(data_file, monkeypatch, cap):
    src, data = data_file
    calls = []
    stock = os.preadv

    def preadv(fd, buffers, offset):  # the kernel returning at most ``cap`` bytes a call
        calls.append(offset)
        if cap is None:
            return stock(fd, buffers, offset)
        kept, left = [], cap
        for b in buffers:
            if not left:
                break
            kept.append(b[:left])
            left -= min(left, b.nbytes)
        return stock(fd, kept, offset)

    monkeypatch.setattr(source_mod.os, "preadv", preadv)
    bufs, views = _buffers([0, 3000, 1, 2048, 0, 5000])
    src.readv("__0_0.distcp", 123, views)
    assert b"".join(bufs) == data[123:123 + 10049]
    assert len(calls) == (1 if cap is None else -(-10049 // cap))


def test_a_file_that_ends_early_is_named_with_what_was_there(data_file):
    src, data = data_file
    _, views = _buffers([5000, 5000])
    with pytest.raises(ReadError, match=r"__0_0\.distcp: ends early: 10000 bytes wanted at offset 15000, "
                                        r"only 5000 there"):
        src.readv("__0_0.distcp", 15000, views)
