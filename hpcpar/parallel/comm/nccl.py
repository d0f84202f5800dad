"""Communicator over NCCL through ``cupy.cuda.nccl``, with the same interface as the MPI one.

The NCCL unique id is created on group rank 0 and broadcast over the group's MPI communicator.
Operations are enqueued on the current CUDA stream and return once enqueued; a ``Request``
from ``isend``/``irecv`` waits on an event recorded after the operation. NCCL has no message
tags (``tag`` is accepted and ignored: order on the stream is the matching rule) and no
uneven all-gather / reduce-scatter, which are done on blocks padded to the longest one.
One process per GPU: NCCL refuses two ranks of a group on the same device.
"""

from __future__ import annotations

import numpy as np

from ..device.dtypes import bfloat16
from ..environment import environment_value
from ..errors import HpcparError
from ..device.waits import wait_bounded, wait_event
from .base import Communicator, Request
from .mpi import MpiCommunicator

_ID_BYTES = 128


def nccl_library_present() -> bool:
    """Whether CuPy's NCCL binding found its library (the import succeeds without it)."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def _nccl():
    if not nccl_library_present():
        raise HpcparError("NCCL is not available through CuPy (no cupy.cuda.nccl, or it found "
                          "no NCCL library); install hpcpar[gpu-cuda12] or [gpu-cuda13], or "
                          "use --comm mpi")
    from cupy.cuda import nccl
    return nccl


def _nccl_dtype(nccl, dtype: np.dtype) -> int:
    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
             np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int64): nccl.NCCL_INT64}
    if hasattr(nccl, "NCCL_BFLOAT16"):
        table[bfloat16] = nccl.NCCL_BFLOAT16
    try:
        return table[np.dtype(dtype)]
    except KeyError:
        raise HpcparError(f"NCCL communicator: dtype {dtype} is not supported "
                          f"(float32, float16, float64, int64)") from None


_BYTES, _SIGNED, _UNSIGNED = 0, 1, 2       # the form CuPy gave the id in


def pack_unique_id(uid) -> np.ndarray:
    """NCCL's unique id as 1 + 128 raw bytes, the first saying the form CuPy returned it in:
    ``bytes`` (newer CuPy) or a tuple of C ``char`` values, signed on x86-64 and unsigned on
    aarch64 (GH200), where values above 127 would overflow an int8 array."""
    msg = np.zeros(_ID_BYTES + 1, dtype=np.uint8)
    if isinstance(uid, (bytes, bytearray)):
        msg[0], msg[1:] = _BYTES, np.frombuffer(bytes(uid), dtype=np.uint8)
    else:
        values = np.array(uid, dtype=np.int64)
        msg[0] = _SIGNED if (values < 0).any() else _UNSIGNED
        msg[1:] = (values & 0xFF).astype(np.uint8)
    return msg


def unpack_unique_id(msg: np.ndarray):
    """The id in the form the sender's CuPy gave it (every rank runs the same CuPy)."""
    raw = np.asarray(msg[1:], dtype=np.uint8)
    if msg[0] == _BYTES:
        return raw.tobytes()
    return tuple(int(v) for v in (raw.view(np.int8) if msg[0] == _SIGNED else raw))


def _share_unique_id(nccl, mpi_comm):
    """Group rank 0 makes the id; everyone receives it over MPI as raw bytes."""
    msg = pack_unique_id(nccl.get_unique_id()) if mpi_comm.Get_rank() == 0 else \
        np.zeros(_ID_BYTES + 1, dtype=np.uint8)
    mpi_comm.Bcast(msg, root=0)
    return unpack_unique_id(msg)


class NcclCommunicator(Communicator):
    kind = "nccl"

    def __init__(self, mpi_comm, backend, stats=None, name="world", timeout=0.0):
        if not backend.is_gpu:
            raise HpcparError("the NCCL communicator needs the cupy backend (a GPU per rank)")
        super().__init__(mpi_comm, backend, stats, name, timeout)
        self._clock = None           # times the queued operations (CUDA events)
        self._lib = _nccl()
        uid = _share_unique_id(self._lib, mpi_comm)
        self._comm = self._lib.NcclCommunicator(self.size, uid, self.rank)


    _over_mpi = MpiCommunicator._over_mpi     # its host twin and sub-groups are MPI ones

    def _device_clock(self):
        if self._clock is None:
            from ..device.backend import DeviceClock
            self._clock = DeviceClock(self.backend)
        return self._clock

    def _stream(self) -> int:
        return self.xp.cuda.get_current_stream().ptr

    def _t(self, a) -> int:
        return _nccl_dtype(self._lib, a.dtype)

    def _nccl_op(self, op: str) -> int:
        return self._lib.NCCL_MAX if op == "max" else self._lib.NCCL_SUM

    def _all_reduce(self, buf, op) -> None:
        ptr = buf.data.ptr
        self._comm.allReduce(ptr, ptr, buf.size, self._t(buf), self._nccl_op(op),
                             self._stream())

    def _iall_reduce(self, buf) -> Request:
        self._all_reduce(buf, "sum")          # enqueued on the stream: already asynchronous
        return self._event_request(buf)

    def _all_gather(self, send, recv, sizes) -> None:
        longest = max(sizes)
        if len(set(sizes)) == 1:
            self._comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._t(send),
                                 self._stream())
            return
        padded = self.xp.zeros((longest,) + send.shape[1:], dtype=send.dtype)
        padded[: send.shape[0]] = send
        gathered = self.xp.empty((self.size,) + padded.shape, dtype=send.dtype)
        self._comm.allGather(padded.data.ptr, gathered.data.ptr, padded.size, self._t(send),
                             self._stream())
        offset = 0
        for r, n in enumerate(sizes):  # drop each block's padding
            recv[offset: offset + n] = gathered[r, :n]
            offset += n

    def _iall_gather(self, send, recv, sizes) -> Request:
        """On the compute stream by default (ordered, asynchronous to the host, not beside
        the compute); with ``HPCPAR_NCCL_OVERLAP=1`` on a stream of its own, after what the
        compute stream queued before it, and ``wait()`` makes the compute stream wait for it
        on the device (ZeRO-3's next layer gathered while this one computes; not run on two
        GPUs yet)."""
        if environment_value("HPCPAR_NCCL_OVERLAP") != "1":
            self._all_gather(send, recv, sizes)
            return self._event_request(send, recv)
        cuda = self.xp.cuda
        compute = cuda.get_current_stream()
        if getattr(self, "_side", None) is None:
            self._side = cuda.Stream(non_blocking=True)
        ready = cuda.Event(disable_timing=True)
        ready.record(compute)
        self._side.wait_event(ready)
        with self._side:
            self._all_gather(send, recv, sizes)
            done = cuda.Event(disable_timing=True)
            done.record(self._side)
        return Request(lambda: compute.wait_event(done), keepalive=(send, recv))

    def _reduce_scatter(self, send, recv, sizes) -> None:
        longest = max(sizes)
        if len(set(sizes)) == 1:
            self._comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self._t(send),
                                     self._lib.NCCL_SUM, self._stream())
            return
        padded = self.xp.zeros((self.size, longest) + send.shape[1:], dtype=send.dtype)
        offset = 0
        for r, n in enumerate(sizes):  # block r at padded[r, :n]
            padded[r, :n] = send[offset: offset + n]
            offset += n
        out = self.xp.empty((longest,) + send.shape[1:], dtype=send.dtype)
        self._comm.reduceScatter(padded.data.ptr, out.data.ptr, out.size, self._t(send),
                                 self._lib.NCCL_SUM, self._stream())
        recv[...] = out[: sizes[self.rank]]

    def _gather(self, send, recv, sizes, root) -> None:
        # NCCL has no gather: grouped point-to-point, as NCCL's own examples do
        self._lib.groupStart()
        if send.size:
            self._comm.send(send.data.ptr, send.size, self._t(send), root, self._stream())
        for r, part in _pieces(recv, sizes) if recv is not None else ():
            self._comm.recv(part.data.ptr, part.size, self._t(part), r, self._stream())
        self._lib.groupEnd()

    def _scatter(self, send, recv, sizes, root) -> None:
        self._lib.groupStart()
        for r, part in _pieces(send, sizes) if send is not None else ():
            self._comm.send(part.data.ptr, part.size, self._t(part), r, self._stream())
        if recv.size:
            self._comm.recv(recv.data.ptr, recv.size, self._t(recv), root, self._stream())
        self._lib.groupEnd()

    def _all_to_all(self, send, send_counts, recv, recv_counts, uneven=False) -> None:
        # NCCL has no all-to-all of uneven blocks: grouped point-to-point, as its examples do
        self._lib.groupStart()
        for r, part in _pieces(send, send_counts):
            self._comm.send(part.data.ptr, part.size, self._t(part), r, self._stream())
        for r, part in _pieces(recv, recv_counts):
            self._comm.recv(part.data.ptr, part.size, self._t(part), r, self._stream())
        self._lib.groupEnd()

    def _reduce(self, buf, root, op) -> None:
        ptr = buf.data.ptr
        self._comm.reduce(ptr, ptr, buf.size, self._t(buf), self._nccl_op(op), root, self._stream())

    def _broadcast(self, buf, root) -> None:
        self._comm.bcast(buf.data.ptr, buf.size, self._t(buf), root, self._stream())

    def _event_request(self, *keepalive) -> Request:
        event = self.xp.cuda.Event(disable_timing=True)
        event.record()
        what = f"an NCCL operation on the {self.name} group (group rank {self.rank})"
        return Request(lambda: wait_event(event, what), keepalive=keepalive)

    def _isend(self, buf, dest, tag) -> Request:
        self._comm.send(buf.data.ptr, buf.size, self._t(buf), dest, self._stream())
        return self._event_request(buf)

    def _irecv(self, buf, source, tag) -> Request:
        self._comm.recv(buf.data.ptr, buf.size, self._t(buf), source, self._stream())
        return self._event_request(buf)

    def _sendrecv(self, send, dest, recv, source, tag) -> None:
        # grouped so that two ranks exchanging with each other cannot deadlock
        self._lib.groupStart()
        self._comm.send(send.data.ptr, send.size, self._t(send), dest, self._stream())
        self._comm.recv(recv.data.ptr, recv.size, self._t(recv), source, self._stream())
        self._lib.groupEnd()

    def _barrier(self) -> None:
        self.backend.synchronize()
        wait_bounded(self.mpi_comm.Ibarrier(), self.timeout, f"barrier on the {self.name} group")


def _pieces(buf, sizes):
    """(rank, its non-empty block of ``buf``) for blocks of ``sizes`` rows, in rank order."""
    offset = 0
    for r, n in enumerate(sizes):
        if n:
            yield r, buf[offset:offset + n]
        offset += n
