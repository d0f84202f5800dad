"""Communicator over mpi4py, using buffer (uppercase) methods only: arrays are never pickled.

Device (CuPy) arrays: the stream is synchronised before every MPI call; the device buffer goes
to MPI directly when the library is CUDA-aware (``cuda_aware``: the library's
MPIX_Query_cuda_support, or ``HPCPAR_CUDA_AWARE``), otherwise it is staged through reusable
page-locked host buffers.

16-bit floats: MPI has no standard half types. Where the library offers one
(``MPIX_C_FLOAT16``, ``MPI_BFLOAT16_T``) it is used; otherwise the data travels as raw 16-bit
words and sums use a user-defined operation that adds in float32 and rounds back.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from ..device import budget
from ..device.dtypes import bfloat16
from ..errors import CommError
from ..device.waits import poll_until, wait_bounded
from . import choice
from .base import Communicator, Request


def cuda_aware() -> tuple[bool, str]:
    """Whether this MPI takes device pointers, and why (``HPCPAR_CUDA_AWARE`` overrides)."""
    import mpi4py

    from ..environment import environment_value  # auto, 1 or 0, checked
    return choice.cuda_aware(environment_value("HPCPAR_CUDA_AWARE"), library_cuda_support(),
                             mpi4py.__version__)


@functools.cache                  # the library is mapped once: ask it once
def library_cuda_support() -> bool | None:
    """The loaded MPI library's own answer (MPIX_Query_cuda_support, Open MPI and MPICH >= 4;
    MPIX_GPU_query_support, MPICH >= 4.1); None where it has neither. mpi4py does not wrap
    them, so they are called through ctypes on the library the process has mapped."""
    import ctypes
    for path in _mapped_mpi_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
        query = getattr(lib, "MPIX_GPU_query_support", None)
        if query is not None:
            supported = ctypes.c_int(0)
            if query(ctypes.c_int(_MPIX_GPU_SUPPORT_CUDA), ctypes.byref(supported)) == 0:
                return bool(supported.value)
    return None


_MPIX_GPU_SUPPORT_CUDA = 0        # mpi.h: a type id, not a flag


def _mapped_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _sum_as_float32(np_dtype: np.dtype) -> MPI.Op:
    """An MPI sum for a 16-bit float format MPI lacks: add in float32, round to the format."""

    def add(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, dtype=np_dtype)
        b = np.frombuffer(inoutbuf, dtype=np_dtype)
        b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(np_dtype)

    return MPI.Op.Create(add, commute=True)


def _predefined(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI datatype for a NumPy type code (MPI.DATATYPE_NULL if none)."""
    try:
        return MPI.Datatype.fromcode(dtype.char)
    except (KeyError, ValueError):
        return MPI.DATATYPE_NULL


class _TypeTable:
    """numpy dtype -> (MPI datatype, sum operation, dtype the buffer is viewed as)."""

    def __init__(self):
        self._cache: dict[np.dtype, tuple] = {}

    def __call__(self, dtype: np.dtype) -> tuple:
        entry = self._cache.get(dtype)
        if entry is None:
            entry = self._cache[dtype] = self._lookup(dtype)
        return entry

    @staticmethod
    def _lookup(dtype: np.dtype) -> tuple:
        if dtype == bfloat16:
            native = getattr(MPI, "BFLOAT16_T", MPI.DATATYPE_NULL)
        elif dtype == np.float16:
            native = _predefined(dtype)
        else:
            return _predefined(dtype), MPI.SUM, dtype
        if native != MPI.DATATYPE_NULL:
            return native, MPI.SUM, np.dtype(np.uint16)
        return MPI.UINT16_T, _sum_as_float32(dtype), np.dtype(np.uint16)


_types = _TypeTable()


class _HostStaging:
    """Page-locked host buffers reused across calls, for MPI libraries that are not CUDA-aware."""

    def __init__(self, backend):
        self._backend = backend
        self._free: dict[int, list] = defaultdict(list)

    def acquire(self, like):
        free = self._free[like.nbytes]
        raw = free.pop() if free else self._backend.empty_host((like.nbytes,), np.uint8)
        return raw.view(like.dtype).reshape(like.shape)

    def release(self, host) -> None:
        self._free[host.nbytes].append(host.reshape(-1).view(np.uint8))


class MpiCommunicator(Communicator):
    kind = "mpi"

    def __init__(self, mpi_comm, backend=None, stats=None, name="world", timeout=0.0):
        from ..device.backend import NUMPY
        super().__init__(mpi_comm, backend or NUMPY, stats, name, timeout)
        self.cuda_aware = self.backend.is_gpu and cuda_aware()[0]
        self._staging = _HostStaging(self.backend)
        self._where = (f" on the {self.name} group (group rank {self.rank} of {self.size}, "
                       f"world rank {MPI.COMM_WORLD.Get_rank()})")

    # ---- buffers ----------------------------------------------------------------------------


    def _over_mpi(self, mpi_comm, backend, name: str) -> "MpiCommunicator":
        return MpiCommunicator(mpi_comm, backend, self.stats, name, self.timeout)

    def _msg(self, buf, count: int | None = None, displs=None):
        """The mpi4py buffer spec for ``buf`` (host or, if CUDA-aware, device)."""
        mpitype, _, view_as = _types(np.dtype(buf.dtype))
        data = buf.view(view_as) if view_as != buf.dtype else buf
        if displs is not None:
            return [data, (count, displs), mpitype]
        return [data, mpitype]

    def _stage_in(self, a):
        """What MPI should read: ``a`` itself, or a host copy of a device array."""
        if not self.backend.is_device_array(a):
            return a
        self.backend.synchronize()
        if self.cuda_aware:
            return a
        host = self._staging.acquire(a)
        with budget.staging():
            a.get(out=host)
        return host

    def _stage_out(self, a):
        """Where MPI should write before the result lands in ``a``. A host staging buffer
        needs no wait for the device (the copy back is queued on the stream after the work
        before it); MPI writing into device memory directly must wait for queued kernels."""
        if not self.backend.is_device_array(a):
            return a
        if not self.cuda_aware:
            return self._staging.acquire(a)
        self.backend.synchronize()
        return a

    def _finish(self, staged, a, copy_back: bool) -> None:
        if staged is a:
            return
        if copy_back:
            with budget.staging():
                a.set(staged)
        self._staging.release(staged)

    # ---- primitives -------------------------------------------------------------------------

    def _all_reduce(self, buf, op) -> None:
        host = self._stage_in(buf)
        self._complete(self.mpi_comm.Iallreduce(MPI.IN_PLACE, self._msg(host),
                                                op=_reduce_op(buf.dtype, op)), "all_reduce")
        self._finish(host, buf, copy_back=True)

    def _iall_reduce(self, buf) -> Request:
        host = self._stage_in(buf)
        req = self.mpi_comm.Iallreduce(MPI.IN_PLACE, self._msg(host),
                                       op=_reduce_op(buf.dtype, "sum"))
        return Request(lambda: self._complete(req, "all_reduce"),
                       lambda: self._finish(host, buf, copy_back=True), (host, buf))

    def _all_gather(self, send, recv, sizes) -> None:
        hsend, hrecv = self._stage_in(send), self._stage_out(recv)
        if len(set(sizes)) == 1:
            req = self.mpi_comm.Iallgather(self._msg(hsend), self._msg(hrecv))
        else:
            counts, displs = _counts_and_displs(sizes, send)
            req = self.mpi_comm.Iallgatherv(self._msg(hsend), self._msg(hrecv, counts, displs))
        self._complete(req, "all_gather")
        self._finish(hsend, send, copy_back=False)
        self._finish(hrecv, recv, copy_back=True)

    def _iall_gather(self, send, recv, sizes) -> Request:
        hsend, hrecv = self._stage_in(send), self._stage_out(recv)
        counts, displs = _counts_and_displs(sizes, send)
        req = self.mpi_comm.Iallgatherv(self._msg(hsend), self._msg(hrecv, counts, displs))

        def finish():
            self._finish(hsend, send, copy_back=False)
            self._finish(hrecv, recv, copy_back=True)
        return Request(lambda: self._complete(req, "all_gather"), finish, (hsend, hrecv, send),
                       test=req.Test)

    def _reduce_scatter(self, send, recv, sizes) -> None:
        hsend, hrecv = self._stage_in(send), self._stage_out(recv)
        _, op, _ = _types(np.dtype(send.dtype))
        # the counts form even for equal blocks: MPICH's Ireduce_scatter_block took 9x the
        # time of Ireduce_scatter at 1 MB (benchmarks/library.py, 2 and 4 ranks)
        req = self.mpi_comm.Ireduce_scatter(self._msg(hsend), self._msg(hrecv), list(sizes),
                                            op=op)
        self._complete(req, "reduce_scatter")
        self._finish(hsend, send, copy_back=False)
        self._finish(hrecv, recv, copy_back=True)

    def _gather(self, send, recv, sizes, root) -> None:
        hsend = self._stage_in(send)
        hrecv = self._stage_out(recv) if recv is not None else None
        counts, displs = _counts_and_displs(sizes, send)
        target = self._msg(hrecv, counts, displs) if hrecv is not None else None
        self._complete(self.mpi_comm.Igatherv(self._msg(hsend), target, root=root), "gather")
        self._finish(hsend, send, copy_back=False)
        if recv is not None:
            self._finish(hrecv, recv, copy_back=True)

    def _scatter(self, send, recv, sizes, root) -> None:
        hsend = self._stage_in(send) if send is not None else None
        hrecv = self._stage_out(recv)
        counts, displs = _counts_and_displs(sizes, recv)
        source = self._msg(hsend, counts, displs) if hsend is not None else None
        self._complete(self.mpi_comm.Iscatterv(source, self._msg(hrecv), root=root), "scatter")
        if send is not None:
            self._finish(hsend, send, copy_back=False)
        self._finish(hrecv, recv, copy_back=True)

    def _all_to_all(self, send, send_counts, recv, recv_counts, uneven=False) -> None:
        hsend, hrecv = self._stage_in(send), self._stage_out(recv)
        if not uneven and len(set(send_counts)) == 1 and len(set(recv_counts)) == 1:
            # equal blocks: MPICH's Ialltoall takes half of Ialltoallv's time from 1 MB
            req = self.mpi_comm.Ialltoall(self._msg(hsend), self._msg(hrecv))
        else:
            req = self.mpi_comm.Ialltoallv(self._msg(hsend, send_counts, _offsets(send_counts)),
                                           self._msg(hrecv, recv_counts, _offsets(recv_counts)))
        self._complete(req, "all_to_all")
        self._finish(hsend, send, copy_back=False)
        self._finish(hrecv, recv, copy_back=True)

    def _reduce(self, buf, root, op) -> None:
        host = self._stage_in(buf)
        mpi_op = _reduce_op(buf.dtype, op)
        if self.rank == root:
            req = self.mpi_comm.Ireduce(MPI.IN_PLACE, self._msg(host), op=mpi_op, root=root)
        else:
            req = self.mpi_comm.Ireduce(self._msg(host), None, op=mpi_op, root=root)
        self._complete(req, "reduce")
        self._finish(host, buf, copy_back=self.rank == root)

    def _broadcast(self, buf, root) -> None:
        host = self._stage_in(buf)
        self._complete(self.mpi_comm.Ibcast(self._msg(host), root=root), "broadcast")
        self._finish(host, buf, copy_back=self.rank != root)

    def _isend(self, buf, dest, tag) -> Request:
        host = self._stage_in(buf)
        req = self.mpi_comm.Isend(self._msg(host), dest=dest, tag=tag)
        return Request(lambda: self._complete(req, f"send to {dest}"),
                       lambda: self._finish(host, buf, copy_back=False), (host, buf), req.Test)

    def _irecv(self, buf, source, tag) -> Request:
        host = self._stage_out(buf)
        req = self.mpi_comm.Irecv(self._msg(host), source=source, tag=tag)
        return Request(lambda: self._complete(req, f"receive from {source}"),
                       lambda: self._finish(host, buf, copy_back=True), (host, buf))

    def probe(self, tag: int, dtype, wait: bool = False,
              what: str | None = None) -> tuple[int, int] | None:
        """A message with ``tag`` from any rank that has arrived: (source, its length in
        ``dtype`` elements), for a receive of the right size; None if there is none yet.
        ``wait``: wait for one, within the group's timeout (``what`` it is, for the error)."""
        status = MPI.Status()
        ready = lambda: self.mpi_comm.Iprobe(MPI.ANY_SOURCE, tag, status)   # noqa: E731
        if wait:
            if self.timeout > 0:
                what = what or f"a message (tag {tag})"
                poll_until(ready, self.timeout, f"waiting for {what}" + self._where)
            else:
                self.mpi_comm.Probe(MPI.ANY_SOURCE, tag, status)
        elif not ready():
            return None
        return status.Get_source(), status.Get_count(_types(np.dtype(dtype))[0])

    def _sendrecv(self, send, dest, recv, source, tag) -> None:
        hsend, hrecv = self._stage_in(send), self._stage_out(recv)
        reqs = [self.mpi_comm.Isend(self._msg(hsend), dest, tag),
                self.mpi_comm.Irecv(self._msg(hrecv), source, tag)]
        for req in reqs:
            self._complete(req, f"sendrecv with {dest}/{source}")
        self._finish(hsend, send, copy_back=False)
        self._finish(hrecv, recv, copy_back=True)

    def _complete(self, req, what: str) -> None:
        wait_bounded(req, self.timeout, what + self._where)

    def _barrier(self) -> None:
        self.backend.synchronize()
        self._complete(self.mpi_comm.Ibarrier(), "barrier")


def _reduce_op(dtype, op: str) -> MPI.Op:
    if op == "sum":
        return _types(np.dtype(dtype))[1]
    if _types(np.dtype(dtype))[2] != np.dtype(dtype):   # 16-bit floats sent as raw words
        raise CommError(f"all_reduce op {op!r} is not available for {dtype}; reduce in float32")
    return MPI.MAX


def _offsets(counts: list[int]) -> list[int]:
    """Where each block starts: plain Python (NumPy's cumsum costs microseconds here)."""
    return [0, *itertools.accumulate(counts[:-1])]


def _counts_and_displs(sizes, block) -> tuple[list[int], list[int]]:
    """Element counts and offsets of each rank's block (leading length ``sizes[r]``)."""
    per_row = math.prod(block.shape[1:])
    counts = [s * per_row for s in sizes]
    return counts, _offsets(counts)
