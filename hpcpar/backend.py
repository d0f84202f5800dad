"""The array module (NumPy on CPU, CuPy on GPU) and everything device-specific.

Model and communication code receive an ``ArrayBackend`` and use ``backend.xp``; only this
module asks whether a GPU is present, picks the device of the node-local rank, synchronises the
stream and allocates pinned host memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .errors import HpcparError
from .waits import wait_event

BACKENDS = ("auto", "numpy", "cupy")


@dataclass(frozen=True)
class ArrayBackend:
    name: str            # "numpy" or "cupy"
    xp: ModuleType       # numpy or cupy
    device_id: int | None = None

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def synchronize(self) -> None:
        """Wait for queued device work (within the job's --timeout: the stream may hold
        NCCL operations waiting on other ranks); call before handing a device buffer to MPI."""
        if self.is_gpu:
            event = self.xp.cuda.Event(disable_timing=True)
            event.record()
            wait_event(event, "waiting for this rank's GPU")

    def is_device_array(self, a: Any) -> bool:
        return self.is_gpu and isinstance(a, self.xp.ndarray)

    def asarray(self, host: np.ndarray):
        """Move a host array to this backend's device (no copy on NumPy)."""
        return self.xp.asarray(host) if self.is_gpu else host

    def to_host(self, a) -> np.ndarray:
        return a.get() if self.is_device_array(a) else np.asarray(a)

    def device_memory_bytes(self) -> int:
        """Bytes CuPy's memory pool holds on this rank's GPU (0 on the CPU)."""
        return self.xp.get_default_memory_pool().total_bytes() if self.is_gpu else 0

    def empty_host(self, shape, dtype) -> np.ndarray:
        """A host buffer for staging device data; page-locked on GPU so copies run at full speed."""
        if self.is_gpu:
            import cupyx
            return cupyx.empty_pinned(shape, dtype=dtype)
        return np.empty(shape, dtype=dtype)


NUMPY = ArrayBackend("numpy", np)


def select_backend(name: str = "auto", local_rank: int = 0) -> ArrayBackend:
    """Choose the array backend; on GPU, rank ``local_rank`` of a node takes device
    ``local_rank % device_count`` (``HPCPAR_BACKEND`` overrides ``auto``)."""
    if name == "auto":
        name = os.environ.get("HPCPAR_BACKEND", "auto")
    if name not in BACKENDS:
        raise HpcparError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "numpy":
        return NUMPY
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, or CUDA present but unusable
        if name == "cupy":
            raise HpcparError(f"backend 'cupy' requested but no usable GPU ({e}); install "
                              "hpcpar[gpu] on a machine with CUDA, or use backend 'numpy'")
        return NUMPY
    if count == 0:
        if name == "cupy":
            raise HpcparError("backend 'cupy' requested but CUDA reports no device")
        return NUMPY
    device_id = local_rank % count
    cupy.cuda.Device(device_id).use()
    return ArrayBackend("cupy", cupy, device_id)
