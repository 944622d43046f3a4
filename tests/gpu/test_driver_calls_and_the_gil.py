"""GPU checks of two claims the save and load paths rest on (marked gpu; skipped without CUDA):

- the copies `cuda_driver` enqueues give up the GIL while in the driver. An async copy enqueued on
  a stream whose queue is full, behind a long kernel, waits in the driver until the device drains
  it: were the GIL held, every other Python thread of the process would stop for that long (a
  save's copy stream sits behind the training stream's work);
- the device grid sums of several large items, compared together once the readers are done
  (`split.DeviceChecks`), each name their own key, on one device or two.
"""

import threading
import time

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("library", ["as_shipped", "keeping_the_gil"])
def test_a_driver_copy_waiting_behind_a_long_kernel_leaves_other_python_threads_running(library, monkeypatch):
    """The control (libcuda called through ctypes.PyDLL, which keeps the GIL) must show the stall,
    so a pass of the shipped form means something."""
    import ctypes

    import torch

    from safe_ckpt import cuda_driver

    if not cuda_driver.copies_available():
        pytest.skip("libcuda has no cuMemcpyDtoHAsync")
    if library == "keeping_the_gil":
        lib = ctypes.PyDLL("libcuda.so.1")
        cuda_driver._declare(lib)
        monkeypatch.setattr(cuda_driver, "_loaded", [lib])
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(5))
    torch.cuda.synchronize()
    assert cuda_driver.current_device() == 0
    stall, stop = [0.0], threading.Event()

    def ticker() -> None:  # the longest this thread went without the GIL
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            stall[0] = max(stall[0], now - last)
            last = now

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    time.sleep(0.05)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(3e9))  # about two seconds of device time ahead of the copies
    longest, calls = 0.0, 0
    try:
        deadline = time.perf_counter() + 30
        for calls in range(1, 300_001):
            t0 = time.perf_counter()
            cuda_driver.memcpy_dtoh_async(host.data_ptr() + (calls % 1024) * 1024, dev.data_ptr(), 1024,
                                          stream.cuda_stream)
            longest = max(longest, time.perf_counter() - t0)
            if calls % 1000 == 0 and (stream.query() or time.perf_counter() > deadline):
                break
    finally:
        stop.set()
        stream.synchronize()
        thread.join()
    print(f"{calls} copies enqueued behind the kernel; the longest call took {longest * 1e3:.1f} ms; "
          f"another Python thread went {stall[0] * 1e3:.1f} ms without the GIL")
    if longest < 0.25:
        pytest.skip(f"no copy waited in the driver (longest call {longest * 1e3:.1f} ms): the queue never filled")
    if library == "keeping_the_gil":
        assert stall[0] >= 0.25, f"the control kept the GIL through a {longest * 1e3:.0f} ms call, yet no thread stalled"
    else:
        assert stall[0] < 0.25, (f"a driver call that waited {longest * 1e3:.0f} ms held the GIL: every other "
                                 f"thread stopped for {stall[0] * 1e3:.0f} ms")


def test_device_summed_items_compared_together_each_name_their_own_key(tmp_path):
    import torch

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import safe_ckpt
    from safe_ckpt import integrity
    from safe_ckpt.errors import ReadError
    from tests.loading.test_load_reads_large_items_in_pieces import PIECE, _as_grid, _flip_payload_byte, _state

    state = _state()  # "a" and "b" are both bigger than a piece; their payloads end in rows of different tails
    devices = {"a": "cuda:0", "b": f"cuda:{min(1, torch.cuda.device_count() - 1)}", "c": "cuda:0"}
    path = str(tmp_path / "ckpt")
    safe_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, path)
    _as_grid(path, "a")
    _as_grid(path, "b")
    summed = []
    stock = integrity.grid_sums

    def grid_sums(payload):
        summed.append(str(payload.device))
        return stock(payload)

    def load():
        reports = []
        out = {k: torch.full_like(v, 7, device=devices[k]) for k, v in state.items()}
        safe_ckpt.load({k: ShardedTensor.from_rank_offsets(k, out[k]) for k in state}, path,
                       safe_ckpt.LoadOptions(io_threads=3, staging_budget_bytes=1 << 20, piece_bytes=PIECE,
                                             batch_bytes=16 << 10, on_read=reports.append))
        torch.cuda.synchronize()
        return out, reports[-1]

    integrity.grid_sums = grid_sums
    try:
        out, report = load()
        assert all(torch.equal(out[k].cpu(), state[k]) for k in state)
        assert report.verified == report.items and report.unverified == 0, report
        assert sorted(summed) == sorted([devices["a"], devices["b"]]), summed
        for key in ("b", "a"):  # the later item in the read-back copy first
            _flip_payload_byte(path, key)
            with pytest.raises(ReadError, match=rf"key '{key}'.*checksum mismatch") as info:
                load()
            assert [f.key for f in info.value.failures] == [key], str(info.value)
            _flip_payload_byte(path, key)
    finally:
        integrity.grid_sums = stock
