"""Which MLX backend arrays go to: settings decided by the device ("auto") ask here."""

from __future__ import annotations

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
