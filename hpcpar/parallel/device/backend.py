"""The array module (NumPy on CPU, CuPy on GPU) and everything device-specific.

Model and communication code receive an ``ArrayBackend`` and use ``backend.xp``; only this
module asks whether a GPU is present, picks the device of the node-local rank, synchronises the
stream and allocates pinned host memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from time import perf_counter
from types import ModuleType
from typing import Any

import numpy as np

from . import budget
from .dtypes import dtype_name
from ..errors import HpcparError
from .waits import wait_event

BACKENDS = ("auto", "numpy", "cupy", "strict")


def host_array(a) -> np.ndarray:
    """A (small) array on the host: a device array's copy, NumPy's as it is."""
    get = getattr(a, "get", None)
    return np.asarray(get() if get is not None else a)


def memory_owner(a):
    """The array that owns ``a``'s memory: the root of its views (NumPy's and CuPy's
    ``base``; for a strict array, of the NumPy array it stands for, whose ``base`` would be
    a new wrapper each time), one object per buffer, so that a buffer is counted once."""
    if type(a).__module__ == "hpcpar.parallel.device.strict_arrays":
        from .strict_arrays import unwrapped
        a = unwrapped(a)
    while hasattr(getattr(a, "base", None), "nbytes"):
        a = a.base
    return a


@dataclass(frozen=True)
class ArrayBackend:
    name: str            # "numpy", "cupy", or "strict" (a pretend device: strict_arrays)
    xp: ModuleType       # numpy, cupy, or strict.xp
    device_id: int | None = None

    @property
    def is_gpu(self) -> bool:
        """Arrays live on a CUDA device (CuPy)."""
        return self.name == "cupy"

    @property
    def on_device(self) -> bool:
        """Arrays are not host memory: they move to and from the host explicitly."""
        return self.name in ("cupy", "strict")

    def synchronize(self) -> None:
        """Wait for queued device work (within the job's --timeout: the stream may hold
        NCCL operations waiting on other ranks); call before handing a device buffer to MPI.
        A device budget counts it as a read (the host waits)."""
        if budget._current is not None and self.on_device:
            budget._current.read()
        if self.is_gpu:
            event = self.xp.cuda.Event(disable_timing=True)
            event.record()
            wait_event(event, "waiting for this rank's GPU")

    def is_device_array(self, a: Any) -> bool:
        return self.on_device and isinstance(a, self.xp.ndarray)

    def asarray(self, host: np.ndarray):
        """Move a host array to this backend's device (no copy on NumPy)."""
        return self.xp.asarray(host) if self.on_device else host

    def copy_in(self, array, host: np.ndarray) -> None:
        """Host data into an existing array of the same shape, in place (a device buffer:
        one upload; CuPy takes it through ``set`` alone)."""
        if self.on_device:
            array.set(np.ascontiguousarray(host, dtype=array.dtype))
        else:
            array[...] = host

    def to_host(self, a) -> np.ndarray:
        return a.get() if self.is_device_array(a) else np.asarray(a)

    def bus_id(self) -> str:
        """The PCI bus id of this rank's GPU ("" without one): unlike the CUDA ordinal it names
        the same physical device in every process, whatever CUDA_VISIBLE_DEVICES says."""
        return self.xp.cuda.Device(self.device_id).pci_bus_id if self.is_gpu else ""

    def device_memory_bytes(self) -> int:
        """Bytes CuPy's memory pool holds on this rank's GPU (0 on the CPU)."""
        return self.xp.get_default_memory_pool().total_bytes() if self.is_gpu else 0

    def free_memory_bytes(self) -> int | None:
        """Memory this rank's arrays can still take: the device's free memory plus the blocks
        CuPy's pool holds free, or the host's available memory for host arrays (None where
        the host does not say)."""
        if self.is_gpu:
            free, _ = self.xp.cuda.runtime.memGetInfo()
            return int(free) + int(self.xp.get_default_memory_pool().free_bytes())
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None

    def release_host_staging(self) -> None:
        """Give back the page-locked blocks CuPy kept from copying weights in (after loading:
        pinned memory is scarce and the pool would hold it for the whole run)."""
        if self.is_gpu:
            self.xp.get_default_pinned_memory_pool().free_all_blocks()

    def release_unused_device_memory(self) -> None:
        """Give the driver back the blocks CuPy's pool keeps free (after building the model:
        the loaded tensors it merged or transposed are free, and the pool would hold them for
        the whole run beside their copies)."""
        if self.is_gpu:
            self.xp.get_default_memory_pool().free_all_blocks()

    def empty_host(self, shape, dtype) -> np.ndarray:
        """A host buffer for staging device data; page-locked on GPU so copies run at full speed."""
        if self.is_gpu:
            import cupyx
            return cupyx.empty_pinned(shape, dtype=dtype)
        return np.empty(shape, dtype=dtype)


NUMPY = ArrayBackend("numpy", np)


def array_module(a) -> ModuleType:
    """The array module of ``a``: NumPy, CuPy, or the strict test backend's."""
    if hasattr(a, "__cuda_array_interface__"):
        import cupy
        return cupy
    if type(a).__module__ == "hpcpar.parallel.device.strict_arrays":
        from .strict_arrays import xp
        return xp
    return np


class DeviceClock:
    """Seconds of device work summed over many intervals.

    On the CPU an interval is host time. On a GPU, work is queued and the host runs ahead, so
    host time measures only the queueing: intervals are bracketed by CUDA events and read once,
    at ``settle()`` (reading each at once would synchronise the stream every time)."""

    def __init__(self, backend: ArrayBackend):
        self._xp = backend.xp if backend.is_gpu else None
        self._open: list[tuple[list, int, Any, Any]] = []

    def now(self):
        if self._xp is None:
            return perf_counter()
        event = self._xp.cuda.Event()
        event.record()
        return event

    def add(self, totals: list, index: int, start) -> None:
        """totals[index] += the time since ``start`` (from ``now()``); on a GPU, once settled."""
        if self._xp is None:
            totals[index] += perf_counter() - start
            return
        self._open.append((totals, index, start, self.now()))

    def settle(self) -> None:
        """Add every open interval (on a GPU: waits for the last one's work to finish)."""
        if not self._open:
            return
        wait_event(self._open[-1][3], "timing this rank's GPU work")   # one stream: in order
        for totals, index, start, end in self._open:
            totals[index] += self._xp.cuda.get_elapsed_time(start, end) / 1000.0
        self._open.clear()


def select_backend(name: str = "auto", local_rank: int = 0, dtype=None) -> ArrayBackend:
    """Choose the array backend; on GPU, rank ``local_rank`` of a node takes device
    ``local_rank % device_count`` (``HPCPAR_BACKEND`` overrides ``auto``). With ``dtype``,
    refuse one the device's arrays cannot compute in."""
    if name == "auto":
        from ..environment import environment_value
        name = environment_value("HPCPAR_BACKEND")
    if name not in BACKENDS:
        raise HpcparError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "numpy":
        return NUMPY
    if name == "strict":
        from .strict_arrays import xp as strict_xp
        return ArrayBackend("strict", strict_xp)
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, or CUDA present but unusable
        if name == "cupy":
            raise HpcparError(f"backend 'cupy' requested but no usable GPU ({e}); install "
                              "hpcpar[gpu-cuda12] or [gpu-cuda13] on a machine with CUDA, or use "
                              "backend 'numpy'")
        return NUMPY
    if count == 0:
        if name == "cupy":
            raise HpcparError("backend 'cupy' requested but CUDA reports no device")
        return NUMPY
    device_id = local_rank % count
    cupy.cuda.Device(device_id).use()
    backend = ArrayBackend("cupy", cupy, device_id)
    if dtype is not None:
        require_dtype(backend.xp, dtype)
    return backend


def require_dtype(xp, dtype) -> None:
    """Refuse, in one line, a float format the array module cannot compute in: CuPy < 14 has
    no bfloat16 (``Unsupported dtype``), found here before any weight is loaded."""
    try:
        a = xp.ones((2, 2), dtype=dtype)
        (a @ a).astype(xp.float32)
    except Exception as e:  # TypeError / ValueError, whatever the CuPy version raises
        version = getattr(xp, "__version__", "?")
        raise HpcparError(f"dtype {dtype_name(dtype)} is not supported by {xp.__name__} "
                          f"{version} ({type(e).__name__}: {e}); use float16 (or float32), or "
                          "a CuPy with bfloat16 (CuPy 14)") from None
