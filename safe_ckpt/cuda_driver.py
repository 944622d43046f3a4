"""The few CUDA driver entry points safe_ckpt calls directly, through ctypes on libcuda (used by
residence, staging and loading alike).

One job: load libcuda once and wrap, with argument types, the calls torch does not offer
at the cost we need: `cuPointerGetAttribute` (is a device address backed by memory? A
copy out of a paused range kills the process instead of raising),
`cuMemcpyDtoHAsync` (one device-to-host copy enqueued for an order of magnitude less of the
issuing thread's time than `Tensor.copy_` on views of a pinned buffer: for a state of a
thousand chunks that is the time every writer waits before its first byte), and its
host-to-device twin `cuMemcpyHtoDAsync` for a load's copies out of pinned pieces.

Must not: create contexts, streams or memory, or synchronize. Callers fall back to torch
where `library()` is None or the calling thread has no current context of the right device.
"""

from __future__ import annotations

import ctypes
import threading

_CUDA_SUCCESS = 0
CU_POINTER_ATTRIBUTE_MAPPED = 13

_lock = threading.Lock()
_loaded: list = []  # [ctypes.CDLL or None], filled once


class CudaDriverError(RuntimeError):
    """A driver call returned an error code; the message names the call and the error."""


def library():
    """libcuda as a ctypes library with the signatures below, or None where it does not load."""
    with _lock:
        if not _loaded:
            lib = None
            for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
                try:
                    lib = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
            if lib is not None:
                _declare(lib)
            _loaded.append(lib)
        return _loaded[0]


def _declare(lib) -> None:
    c_int, c_void_p, c_u64, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
    lib.cuPointerGetAttribute.restype = c_int
    lib.cuPointerGetAttribute.argtypes = [c_void_p, c_int, c_u64]
    # Symbols missing from an old driver leave only the torch path (see `copies_available`).
    for name, args in (("cuMemcpyDtoHAsync_v2", [c_void_p, c_u64, c_size_t, c_void_p]),
                       ("cuMemcpyHtoDAsync_v2", [c_u64, c_void_p, c_size_t, c_void_p]),
                       ("cuCtxGetCurrent", [ctypes.POINTER(c_void_p)]),
                       ("cuCtxGetDevice", [ctypes.POINTER(c_int)]),
                       ("cuGetErrorName", [c_int, ctypes.POINTER(ctypes.c_char_p)])):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = c_int
            fn.argtypes = args


def error_name(rc: int) -> str:
    lib = library()
    name = ctypes.c_char_p()
    if lib is not None and getattr(lib, "cuGetErrorName", None) is not None \
            and lib.cuGetErrorName(rc, ctypes.byref(name)) == _CUDA_SUCCESS and name.value:
        return name.value.decode()
    return f"CUDA error {rc}"


def address_mapped(address: int) -> bool:
    """Whether the driver reports physical memory behind ``address``.

    An address the driver does not know at all (unmapped VMM range, freed memory)
    answers CUDA_ERROR_INVALID_VALUE; for a tensor torch places on a CUDA device that
    means its pages are gone, so it counts as unmapped.
    """
    lib = _required()
    value = ctypes.c_uint64(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(value), CU_POINTER_ATTRIBUTE_MAPPED, ctypes.c_uint64(address))
    return rc == _CUDA_SUCCESS and value.value != 0


def copies_available() -> bool:
    lib = library()
    return lib is not None and all(getattr(lib, n, None) is not None
                                   for n in ("cuMemcpyDtoHAsync_v2", "cuCtxGetCurrent", "cuCtxGetDevice"))


def htod_copies_available() -> bool:
    lib = library()
    return lib is not None and all(getattr(lib, n, None) is not None
                                   for n in ("cuMemcpyHtoDAsync_v2", "cuCtxGetCurrent", "cuCtxGetDevice"))


def _required():
    lib = library()
    if lib is None:
        raise CudaDriverError("the CUDA driver library (libcuda) cannot be loaded")
    return lib


def current_device() -> int | None:
    """The device of the calling thread's current context, or None where it has none."""
    lib = _required()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != _CUDA_SUCCESS or not ctx.value:
        return None
    device = ctypes.c_int(-1)
    if lib.cuCtxGetDevice(ctypes.byref(device)) != _CUDA_SUCCESS:
        return None
    return device.value


def memcpy_dtoh_async(dst_address: int, src_address: int, nbytes: int, stream_handle: int) -> None:
    """Enqueue a copy of ``nbytes`` from device ``src_address`` to host ``dst_address`` on the
    stream (a raw CUstream, e.g. `torch.cuda.Stream.cuda_stream`); the destination must be
    page-locked for the copy to be asynchronous (into pageable memory it runs synchronously)."""
    rc = _required().cuMemcpyDtoHAsync_v2(dst_address, src_address, nbytes, stream_handle)
    if rc != _CUDA_SUCCESS:
        raise CudaDriverError(f"cuMemcpyDtoHAsync of {nbytes} bytes from {src_address:#x} failed: {error_name(rc)}")


def memcpy_htod_async(dst_address: int, src_address: int, nbytes: int, stream_handle: int) -> None:
    """Enqueue a copy of ``nbytes`` from host ``src_address`` to device ``dst_address`` on the
    stream (a raw CUstream); the source must be page-locked for the copy to be asynchronous."""
    rc = _required().cuMemcpyHtoDAsync_v2(dst_address, src_address, nbytes, stream_handle)
    if rc != _CUDA_SUCCESS:
        raise CudaDriverError(f"cuMemcpyHtoDAsync of {nbytes} bytes to {dst_address:#x} failed: {error_name(rc)}")
