"""Which MLX backend arrays go to: settings decided by the device ("auto") ask here."""

from __future__ import annotations

import ctypes
import functools
import os

import mlx.core as mx


def cuda_available() -> bool:
    """Whether this MLX build has a usable CUDA GPU (mx.cuda is absent from Metal and CPU-only builds)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


def on_gpu() -> bool:
    """Whether arrays go to a GPU (CUDA or Metal), whose scatter-adds and attention backward sum with atomics."""
    return mx.default_device() != mx.cpu


def on_cuda() -> bool:
    """Whether arrays go to a CUDA GPU: the default device is the GPU and the build is a CUDA one."""
    return mx.default_device().type == mx.gpu and cuda_available()


def device_memory() -> int:
    """Bytes of the device's memory (the machine's RAM where MLX does not report it, as on the CPU). MLX names it
    memory_size on Metal and total_memory on CUDA."""
    info = mx.device_info()
    reported = info.get("memory_size") or info.get("total_memory")
    return int(reported or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


# CUmemPool_attribute values (cuda.h): bytes the pool holds from the device, and bytes handed out of it.
_POOL_RESERVED, _POOL_USED = 5, 7


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver, initialised once; None where there is none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return None if cuda.cuInit(0) else cuda


@functools.cache
def _default_pool(device: int) -> ctypes.c_void_p | None:
    """Device `device`'s default memory pool, looked up once."""
    pool = ctypes.c_void_p()
    return None if _driver().cuDeviceGetDefaultMemPool(ctypes.byref(pool), device) else pool


def cuda_pool_memory() -> dict[str, int] | None:
    """Bytes the CUDA device's default memory pool (where MLX allocates, cudaMallocAsync) has reserved from the
    device (`pool_reserved`) and has handed out (`pool_used`), and bytes of the device in use by anyone
    (`device_used`, the driver's total less free): reserved beyond MLX's active and cached buffers is freed memory
    the pool keeps, and device_used beyond reserved is memory outside the pool (context, libraries' workspaces,
    CUDA graphs); MLX's own counts show neither. None off CUDA, before MLX has made a context current on this thread,
    or where the driver does not answer."""
    cuda = _driver() if on_cuda() else None
    device = ctypes.c_int()
    if cuda is None or cuda.cuCtxGetDevice(ctypes.byref(device)):  # MLX's device: mx.Device carries no index
        return None
    pool = _default_pool(device.value)
    if pool is None:
        return None
    out = {}
    for name, attribute in (("pool_reserved", _POOL_RESERVED), ("pool_used", _POOL_USED)):
        value = ctypes.c_uint64()
        if cuda.cuMemPoolGetAttribute(pool, attribute, ctypes.byref(value)):
            return None
        out[name] = value.value
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0:
        out["device_used"] = total.value - free.value
    return out
