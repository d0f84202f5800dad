"""Collectives and point-to-point messages over MPI or NCCL, behind one interface."""

from __future__ import annotations

import socket
import zlib

import numpy as np

from ..backend import NUMPY, ArrayBackend
from ..errors import HpcparError
from .base import CommStats, Communicator, Request, split_sizes
from .mpi import MpiCommunicator, cuda_aware

COMM_KINDS = ("auto", "mpi", "nccl")

__all__ = ["COMM_KINDS", "CommStats", "Communicator", "MpiCommunicator", "Request",
           "create_communicator", "cuda_aware", "split_sizes"]


def create_communicator(mpi_comm, kind: str = "auto", backend: ArrayBackend = NUMPY,
                        stats: CommStats | None = None, name: str = "world",
                        timeout: float = 0.0) -> Communicator:
    """A communicator over the ranks of ``mpi_comm`` (collective over that group).

    ``auto`` takes NCCL when arrays live on GPUs, CuPy has NCCL, and no two ranks of the group
    share a device (NCCL refuses that); MPI otherwise.
    """
    if kind not in COMM_KINDS:
        raise HpcparError(f"communicator {kind!r} is not one of {', '.join(COMM_KINDS)}")
    if kind == "auto":
        kind = "nccl" if _nccl_usable(mpi_comm, backend) else "mpi"
    if kind == "nccl":
        from .nccl import NcclCommunicator
        return NcclCommunicator(mpi_comm, backend, stats, name, timeout)
    return MpiCommunicator(mpi_comm, backend, stats, name, timeout)


def _nccl_usable(mpi_comm, backend: ArrayBackend) -> bool:
    if not backend.is_gpu:
        return False
    try:
        from cupy.cuda import nccl  # noqa: F401
        have_nccl = 1
    except ImportError:
        have_nccl = 0
    host = zlib.crc32(socket.gethostname().encode())
    mine = np.array([host, backend.device_id, have_nccl], dtype=np.int64)
    everyone = np.empty((mpi_comm.Get_size(), 3), dtype=np.int64)
    mpi_comm.Allgather(mine, everyone)
    devices = {(int(h), int(d)) for h, d, _ in everyone}
    return bool(everyone[:, 2].all()) and len(devices) == mpi_comm.Get_size()
