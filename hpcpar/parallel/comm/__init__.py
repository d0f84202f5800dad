"""Collectives and point-to-point messages over MPI or NCCL, behind one interface."""

from __future__ import annotations

import socket

import numpy as np

from ..device.backend import NUMPY, ArrayBackend
from ..errors import HpcparError
from . import choice
from .base import CommStats, Communicator, Request, split_sizes
from .mpi import MpiCommunicator, cuda_aware
from .nccl import nccl_library_present

COMM_KINDS = ("auto", "mpi", "nccl")

__all__ = ["COMM_KINDS", "CommStats", "Communicator", "MpiCommunicator", "Request",
           "create_communicator", "cuda_aware", "split_sizes"]


def create_communicator(mpi_comm, kind: str = "auto", backend: ArrayBackend = NUMPY,
                        stats: CommStats | None = None, name: str = "world",
                        timeout: float = 0.0, check: bool = True) -> Communicator:
    """A communicator over the ranks of ``mpi_comm`` (collective over that group when ``kind``
    is auto or nccl: the ranks compare their GPUs, see ``choice``). ``check``: every
    collective first checks that the ranks pass agreeing shapes, dtypes and sizes
    (``agreement``); the jobs' own groups, whose arguments come from one plan, leave it off."""
    if kind not in COMM_KINDS:
        raise HpcparError(f"communicator {kind!r} is not one of {', '.join(COMM_KINDS)}")
    if kind != "mpi":
        kind = choice.choose(kind, backend.is_gpu, _devices(mpi_comm, backend))
    if kind == "nccl":
        from .nccl import NcclCommunicator
        group = NcclCommunicator(mpi_comm, backend, stats, name, timeout)
    else:
        group = MpiCommunicator(mpi_comm, backend, stats, name, timeout)
    group.check = check
    return group


_FIELD = 64     # bytes per host name / bus id in the exchange


def _devices(mpi_comm, backend: ArrayBackend) -> list[choice.RankDevice]:
    """Every group rank's host, GPU bus id and NCCL library (one Allgather of bytes)."""
    if not backend.is_gpu:
        return []
    mine = np.zeros(2 * _FIELD + 1, dtype=np.uint8)
    for i, text in enumerate((socket.gethostname(), backend.bus_id())):
        raw = text.encode()[:_FIELD]
        mine[i * _FIELD: i * _FIELD + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    mine[-1] = nccl_library_present()
    rows = np.empty((mpi_comm.Get_size(), mine.size), dtype=np.uint8)
    mpi_comm.Allgather(mine, rows)
    return [choice.RankDevice(_text(r[:_FIELD]), _text(r[_FIELD:2 * _FIELD]), bool(r[-1]))
            for r in rows]


def _text(raw: np.ndarray) -> str:
    return raw.tobytes().rstrip(b"\0").decode(errors="replace")
