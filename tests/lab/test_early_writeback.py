"""Early writeback, the lab's diagnostic (`safe_ckpt_lab.diag.writeback`, measured by
benchmarks/diag/diag_ttd.py; the library leaves writeback to fsync): which byte runs it hands
to the kernel, what it does when the kernel refuses, and that files it touched hold exactly
what was written."""

import ctypes
import errno
import os

import pytest
import torch

from safe_ckpt_lab.diag import writeback

MiB = 1 << 20


def _random_bytes(n: int, seed: int) -> bytes:
    return torch.empty(n, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


@pytest.fixture
def threshold():
    return 4 * MiB


def _file(path, threshold, fsync=True):
    return writeback.WritebackFile(str(path), fsync, threshold)


def _recording(monkeypatch, result=0, code=0):
    calls = []

    def fake(fd, offset, length, flags):
        calls.append((offset, length, flags))
        ctypes.set_errno(code)
        return result

    monkeypatch.setattr(writeback, "_sync_file_range", fake)
    return calls


WRITE = 2  # SYNC_FILE_RANGE_WRITE in <fcntl.h>: spelled out, so a wrong constant in the code fails


def _kernel_starts_writeback(path) -> bool:
    if writeback._sync_file_range is None:
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"probe", 0)
        return writeback._sync_file_range(fd, 0, 5, WRITE) == 0
    finally:
        os.close(fd)
        os.unlink(path)


def test_real_kernel_call_starts_runs_and_the_file_is_exact(tmp_path, threshold):
    if not _kernel_starts_writeback(tmp_path / "probe"):
        pytest.skip("this kernel or filesystem refuses sync_file_range")
    data = _random_bytes(10 * MiB + 123, seed=11)
    f = _file(tmp_path / "a", threshold)
    for off in range(0, len(data), MiB):
        f.write_at(off, [data[off:off + MiB]])
    started = f.writeback.started_bytes
    f.sync()
    f.close()
    assert started == 8 * MiB  # two full 4 MiB runs; the tail is left to fsync
    assert (tmp_path / "a").read_bytes() == data


@pytest.mark.skipif(writeback._sync_file_range is None, reason="no sync_file_range in this libc")
def test_the_binding_passes_64_bit_offsets_and_reads_errno(tmp_path):
    fd = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        # A negative offset is EINVAL; truncated to 32 bits this one would read as 0 and pass.
        assert writeback._sync_file_range(fd, -(1 << 32), 4096, WRITE) == -1
        assert ctypes.get_errno() == errno.EINVAL
    finally:
        os.close(fd)


@pytest.mark.skipif(writeback._sync_file_range is None, reason="no sync_file_range in this libc")
def test_a_real_refusal_turns_it_off_and_a_real_error_is_raised(tmp_path):
    read_end, write_end = os.pipe()
    try:
        pipe = writeback.EarlyWriteback(write_end, "a pipe", 1)
        pipe.wrote(0, 10)  # ESPIPE from the kernel: left to fsync, not an error
        pipe.wrote(10, 10)
        assert pipe.started_bytes == 0 and not pipe._enabled
    finally:
        os.close(read_end)
        os.close(write_end)
    fd = os.open(tmp_path / "closed", os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
    closed = writeback.EarlyWriteback(fd, str(tmp_path / "closed"), 1)
    with pytest.raises(OSError) as info:
        closed.wrote(0, 10)
    assert info.value.errno == errno.EBADF and info.value.filename == str(tmp_path / "closed")
    assert "bytes 0-10" in str(info.value)


def test_runs_follow_contiguous_writes_and_a_jump_leaves_the_short_run_to_fsync(tmp_path, threshold, monkeypatch):
    calls = _recording(monkeypatch)
    f = _file(tmp_path / "b", threshold)
    piece = _random_bytes(MiB, seed=3)
    for off in (0, MiB, 2 * MiB):  # 3 MiB pending, under the threshold
        f.write_at(off, [piece])
    f.write_at(20 * MiB, [piece])  # not contiguous: a new run; the 3 MiB are left to fsync
    assert calls == []
    for off in (21 * MiB, 22 * MiB, 23 * MiB):
        f.write_at(off, [piece])
    assert calls == [(20 * MiB, 4 * MiB, WRITE)]
    assert f.writeback.started_bytes == 4 * MiB
    f.close()


def test_first_write_elsewhere_backward_writes_and_empty_writes(threshold, monkeypatch):
    calls = _recording(monkeypatch)
    wb = writeback.EarlyWriteback(-1, "p", threshold)
    wb.wrote(5 * MiB, 3 * MiB)
    wb.wrote(8 * MiB, 0)  # an empty write neither breaks nor extends the run
    wb.wrote(8 * MiB, MiB)
    assert calls == [(5 * MiB, 4 * MiB, WRITE)]
    for k in (3, 2, 1, 0):  # backward, MiB by MiB: never a run of 4 MiB, so no calls
        wb.wrote(k * MiB, MiB)
    wb.wrote(40 * MiB, 0)
    assert calls == [(5 * MiB, 4 * MiB, WRITE)]
    wb.wrote(1 * MiB, 4 * MiB)  # continues the last backward write's run (0-1 MiB)
    assert calls[1:] == [(0, 5 * MiB, WRITE)]
    assert wb.started_bytes == 9 * MiB


def test_a_vectored_write_counts_every_buffer(tmp_path, threshold, monkeypatch):
    calls = _recording(monkeypatch)
    f = _file(tmp_path / "c", threshold)
    f.write_at(0, [b"x" * 100, _random_bytes(4 * MiB, seed=4), b"y" * 28])
    assert calls == [(0, 4 * MiB + 128, WRITE)]
    f.close()


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP])
def test_a_kernel_or_file_that_cannot_is_left_to_fsync(tmp_path, threshold, monkeypatch, code):
    calls = _recording(monkeypatch, result=-1, code=code)
    f = _file(tmp_path / "d", threshold)
    data = _random_bytes(12 * MiB, seed=5)
    for off in range(0, len(data), 4 * MiB):
        f.write_at(off, [data[off:off + 4 * MiB]])
    assert len(calls) == 1  # asked once, then not again for this file
    assert f.writeback.started_bytes == 0
    f.sync()
    f.close()
    assert (tmp_path / "d").read_bytes() == data


def test_a_failed_writeback_is_the_write_failure_and_names_the_file(tmp_path, threshold, monkeypatch):
    _recording(monkeypatch, result=-1, code=errno.EIO)
    path = str(tmp_path / "e")
    f = _file(path, threshold)
    with pytest.raises(OSError) as info:
        f.write_at(0, [_random_bytes(4 * MiB, seed=6)])
    assert info.value.errno == errno.EIO and info.value.filename == path
    f.close()


def test_off_without_fsync_or_at_zero(tmp_path):
    unsynced = _file(tmp_path / "f", 4 * MiB, fsync=False)
    at_zero = _file(tmp_path / "g", 0)
    try:
        assert unsynced.writeback is None and at_zero.writeback is None
    finally:
        unsynced.close()
        at_zero.close()


def test_no_libc_function_means_no_calls(tmp_path, threshold, monkeypatch):
    monkeypatch.setattr(writeback, "_sync_file_range", None)
    f = _file(tmp_path / "h", threshold)
    data = _random_bytes(8 * MiB, seed=7)
    f.write_at(0, [data])
    assert f.writeback.started_bytes == 0
    f.close()
    assert os.path.getsize(tmp_path / "h") == len(data)
