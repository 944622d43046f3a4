"""The ctypes layer over libcuda: what callers get when a call fails or a symbol is missing.

The real library is exercised on the GPU machine (tests/gpu/test_device_saves.py: every device save
copies through it, and `test_device_checksums` also through torch with it switched off; every
load into GPU templates in tests/gpu/test_load_into_gpu.py, with and without it).
Here a stand-in object takes libcuda's place: it has the same function names and returns
the same kinds of codes, so the error paths run without a GPU.
"""

import ctypes

import pytest

from safe_ckpt import cuda_driver


class _FakeFn:
    def __init__(self, impl):
        self.impl = impl
        self.argtypes = None
        self.restype = None

    def __call__(self, *args):
        return self.impl(*args)


class _FakeDriver:
    """Stands for libcuda: a failing copy (CUDA_ERROR_ILLEGAL_ADDRESS, 700) and no context."""

    def __init__(self, copy_rc=700, with_ctx=False):
        def get_current(pctx):
            ctypes.cast(pctx, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1234 if with_ctx else None
            return 0

        def get_device(pdev):
            ctypes.cast(pdev, ctypes.POINTER(ctypes.c_int))[0] = 3
            return 0

        def error_name(rc, pstr):
            ctypes.cast(pstr, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_ILLEGAL_ADDRESS"
            return 0

        self.cuMemcpyDtoHAsync_v2 = _FakeFn(lambda *a: copy_rc)
        self.cuMemcpyHtoDAsync_v2 = _FakeFn(lambda *a: copy_rc)
        self.cuCtxGetCurrent = _FakeFn(get_current)
        self.cuCtxGetDevice = _FakeFn(get_device)
        self.cuGetErrorName = _FakeFn(error_name)
        self.cuPointerGetAttribute = _FakeFn(lambda *a: 1)  # CUDA_ERROR_INVALID_VALUE


@pytest.fixture
def fake(monkeypatch):
    def install(**kw):
        lib = _FakeDriver(**kw)
        monkeypatch.setattr(cuda_driver, "_loaded", [lib])
        return lib
    return install


def test_a_failed_copy_raises_with_the_error_name_size_and_address(fake):
    fake()
    with pytest.raises(cuda_driver.CudaDriverError) as info:
        cuda_driver.memcpy_dtoh_async(0x1000, 0x7F0000000000, 4096, 0)
    text = str(info.value)
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in text and "4096 bytes" in text and "0x7f0000000000" in text


def test_a_failed_host_to_device_copy_raises_with_the_error_name_size_and_address(fake):
    fake()
    with pytest.raises(cuda_driver.CudaDriverError) as info:
        cuda_driver.memcpy_htod_async(0x7F0000002000, 0x1000, 8192, 0)
    text = str(info.value)
    assert "cuMemcpyHtoDAsync" in text and "CUDA_ERROR_ILLEGAL_ADDRESS" in text and "8192 bytes" in text \
        and "0x7f0000002000" in text


def test_a_thread_without_a_context_has_no_current_device(fake):
    fake(with_ctx=False)
    assert cuda_driver.current_device() is None
    fake(with_ctx=True)
    assert cuda_driver.current_device() == 3


def test_missing_symbols_leave_only_the_torch_path(fake, monkeypatch):
    lib = fake()
    assert cuda_driver.copies_available()
    del lib.cuMemcpyDtoHAsync_v2
    assert not cuda_driver.copies_available()
    monkeypatch.setattr(cuda_driver, "_loaded", [None])
    assert not cuda_driver.copies_available()
    with pytest.raises(RuntimeError, match="libcuda"):
        cuda_driver.address_mapped(0x1000)


def test_an_unknown_address_counts_as_unmapped(fake):
    fake()
    assert cuda_driver.address_mapped(0x1000) is False


def test_loading_declares_the_library(monkeypatch):
    made = []

    class Loaded(_FakeDriver):
        def __init__(self, name):
            super().__init__()
            self._name = name
            made.append(self)

    monkeypatch.setattr(cuda_driver, "_loaded", [])
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Loaded(name))
    lib = cuda_driver.library()
    assert lib._name == "libcuda.so.1"
    # declared: arguments typed for ctypes (an untyped 64-bit address would be truncated)
    assert lib.cuMemcpyDtoHAsync_v2.argtypes and lib.cuMemcpyDtoHAsync_v2.restype is ctypes.c_int
    # the device address first, as a 64-bit integer; the host address second
    assert lib.cuMemcpyHtoDAsync_v2.argtypes[:2] == [ctypes.c_uint64, ctypes.c_void_p]
    assert lib.cuMemcpyHtoDAsync_v2.restype is ctypes.c_int
    assert cuda_driver.library() is lib and len(made) == 1  # loaded once


def test_without_the_host_to_device_symbol_a_load_copies_through_torch(fake):
    lib = fake()
    assert cuda_driver.htod_copies_available()
    del lib.cuMemcpyHtoDAsync_v2
    assert not cuda_driver.htod_copies_available() and cuda_driver.copies_available()
