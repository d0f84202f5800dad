"""The communicator interface shared by the MPI and NCCL implementations.

``Communicator`` does the array bookkeeping once: it makes input contiguous (at most one copy),
moves the gathered / scattered axis to the front so every rank's block is one contiguous run of
memory, splits uneven lengths like ``numpy.array_split`` (remainder to the first ranks), counts
the bytes and time of every call, and names the operation and group when one fails. Subclasses
only move contiguous buffers: ``_all_reduce``, ``_iall_reduce``, ``_all_gather``,
``_reduce_scatter``, ``_gather``, ``_scatter``, ``_reduce``, ``_broadcast``, ``_isend``,
``_irecv``, ``_sendrecv``, ``_barrier``.
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from time import perf_counter
from typing import Callable, Iterable, Sequence

import numpy as np

from .. import trace
from ..device.backend import NUMPY, ArrayBackend
from ..errors import CommError, HpcparError, Stopped
from ..tensor.splits import even_sizes as split_sizes
from .agreement import active, agree, dtype_name
from .failfast import fails_together
from .stats import CommStats

REDUCE_OPS = ("sum", "max")


class Request:
    """A pending non-blocking send or receive. ``wait()`` completes it, including any copy of
    staged data back to the device, and keeps the buffers alive until then."""

    label = "request"       # what a trace calls its wait ("pp.recv"; set by the communicator)
    nbytes = 0              # and the bytes it moves

    def __init__(self, wait: Callable[[], None], on_complete: Callable[[], None] | None = None,
                 keepalive: tuple = (), test: Callable[[], bool] | None = None):
        self._wait = wait
        self._on_complete = on_complete
        self._keepalive = keepalive
        self._test = test
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        tracer = trace.current()
        begin = perf_counter() if tracer is not None else 0.0
        self._wait()
        self._complete()
        if tracer is not None:
            tracer.add(f"wait {self.label}", "wait", begin, perf_counter(),
                       {"bytes": self.nbytes} if self.nbytes else None)

    def test(self) -> bool:
        """Whether the operation is complete (then as after ``wait()``), without waiting;
        False where the implementation cannot tell without waiting."""
        if not self.done and self._test is not None and self._test():
            self._complete()
        return self.done

    def _complete(self) -> None:
        if self._on_complete is not None:
            self._on_complete()
        self.done = True
        self._keepalive = ()

    @staticmethod
    def wait_all(requests: Iterable["Request"]) -> None:
        for r in requests:
            r.wait()


class Communicator(ABC):
    """Collectives and point-to-point messages over one group of ranks.

    Reductions are sums (``all_reduce`` also takes the max). Arrays may be NumPy or (on a GPU
    backend) CuPy; dtypes float32, float16, bfloat16, float64 and int64 are supported by every
    implementation.
    """

    kind = "abstract"

    def __init__(self, mpi_comm, backend: ArrayBackend = NUMPY, stats: CommStats | None = None,
                 name: str = "world", timeout: float = 0.0):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.backend = backend
        self.xp = backend.xp
        self.stats = stats if stats is not None else CommStats()
        self.name = name
        self.timeout = timeout        # seconds any wait may take (0: forever)
        self.error_board = None       # its mesh's (``failfast.ErrorBoard``), where it has one
        # check that the ranks pass agreeing shapes, dtypes and sizes to every collective
        # (``agreement``): a library user's groups do, the jobs' hot paths do not
        self.check = False
        self._ops: dict = {}                 # prepared operations by kind, shape, dtype, ...
        self._host_twin: Communicator | None = None
        self._world_ranks: tuple[int, ...] | None = None

    def world_ranks(self) -> tuple[int, ...]:
        """The world rank of each member, in group order (found once): the ranks that run
        this group's calls together."""
        if getattr(self, "_world_ranks", None) is None:
            from .agreement import world_ranks_of
            self._world_ranks = tuple(world_ranks_of(self.mpi_comm))
        return self._world_ranks

    def on_host(self) -> "Communicator":
        """This group over MPI with host (NumPy) arrays, for small metadata (schedules,
        lengths) that has no reason to visit the device. Made once, on first use."""
        if not self.backend.on_device and self.kind == "mpi":
            return self
        if self._host_twin is None:
            self._host_twin = self._over_mpi(self.mpi_comm, NUMPY, self.name)
            self._host_twin.error_board = self.error_board
        return self._host_twin

    def split(self, color: int, name: str) -> "Communicator":
        """The ranks of this group passing the same ``color``, as a group of their own over
        MPI, in this group's order (collective)."""
        group = self._over_mpi(self.mpi_comm.Split(color, self.rank), self.backend,
                               f"{self.name}.{name}")
        group.check, group.error_board = self.check, self.error_board
        return group

    # ---- public API -----------------------------------------------------------------------

    @fails_together
    def all_reduce(self, x, op: str = "sum"):
        """x <- sum (or max, with ``op="max"``) of x over the group, in place; returns x."""
        error = None if op in REDUCE_OPS else HpcparError(
            f"all_reduce: op {op!r} is not one of {', '.join(REDUCE_OPS)}")
        if self.size == 1 and error is None:
            return x
        self._agree("all_reduce", lambda: (("op", op), *_array_fields(x)), error)
        return self._in_place("all_reduce", x, self._all_reduce, op)

    @fails_together
    def iall_reduce(self, x) -> Request:
        """Start summing ``x`` (contiguous) over the group in place; the sum is in ``x`` once
        the returned request's ``wait()`` returns. Do not touch ``x`` before that."""
        _require_contiguous(x, "iall_reduce")
        if self.size == 1:
            return Request(lambda: None)
        self._agree("iall_reduce", lambda: _array_fields(x))
        return self._run("all_reduce", x.nbytes, self._iall_reduce, x)

    @fails_together
    def all_gather(self, x, axis: int = 0, sizes: Sequence[int] | None = None, out=None):
        """Concatenate every rank's ``x`` along ``axis`` in rank order.

        Blocks may differ in length along ``axis``: pass every rank's length as ``sizes``
        (the other dimensions must agree). Returns a new array, or fills ``out`` (reused
        buffers save an allocation per call on hot paths)."""
        gather, error = _attempt(self.all_gather_op, x, axis, sizes, out=out)
        self._agree("all_gather", lambda: _block_fields(x, axis, sizes), error)
        return gather(x, out)

    @fails_together
    def iall_gather(self, x, sizes: Sequence[int], out) -> Request:
        """Start gathering every rank's ``x`` (1-D: ``sizes[r]`` elements on rank r) into
        ``out`` (1-D, contiguous, ``sum(sizes)`` elements) in rank order; complete once the
        returned request's ``wait()`` returns. Touch neither before that (ZeRO-3 gathers the
        next layer's weights while this one computes)."""
        sizes = [int(n) for n in sizes]
        error = None
        if (x.ndim != 1 or out.ndim != 1 or len(sizes) != self.size
                or sizes[self.rank] != x.size or sum(sizes) != out.size or x.dtype != out.dtype):
            error = HpcparError(
                f"iall_gather on {self.name}: x {tuple(x.shape)} {x.dtype} and out "
                f"{tuple(out.shape)} {out.dtype} must be 1-D of one dtype, x of sizes[rank] and "
                f"out of sum(sizes) elements ({sizes} over {self.size} ranks)")
        else:
            _require_contiguous(out, "iall_gather")
        self._agree("iall_gather", lambda: (("sizes", tuple(sizes)),
                                            ("dtype", dtype_name(x.dtype))), error)
        if self.size == 1:
            out[...] = x
            return Request(lambda: None)
        return self._run("all_gather", out.nbytes, self._iall_gather,
                         self.xp.ascontiguousarray(x), out, sizes)

    @fails_together
    def reduce_scatter(self, x, axis: int = 0, out=None, sizes: Sequence[int] | None = None):
        """Sum ``x`` over the group and keep this rank's block along ``axis``: blocks of
        ``sizes`` (every rank's length), by default split like ``numpy.array_split``;
        returns a new array, or fills ``out``."""
        scatter, error = _attempt(self.reduce_scatter_op, x, axis, sizes, out=out)
        self._agree("reduce_scatter",
                    lambda: (("axis", axis), ("sizes", sizes and tuple(sizes)), *_array_fields(x)),
                    error)
        return scatter(x, out)

    @fails_together
    def all_to_all(self, x, split_axis: int, concat_axis: int,
                   split_sizes: Sequence[int] | None = None,
                   concat_sizes: Sequence[int] | None = None):
        """Cut ``x`` along ``split_axis`` into one block per rank (``split_sizes``, default
        even), send block j to rank j, and concatenate what every rank sent this one along
        ``concat_axis`` in rank order (rank j's block is ``concat_sizes[j]`` long there,
        default this rank's own length). Redistributes an array sharded along
        ``concat_axis`` into one sharded along ``split_axis``; returns a new array."""
        exchange, error = _attempt(self.all_to_all_op, x, split_axis, concat_axis,
                                   split_sizes, concat_sizes)
        self._agree("all_to_all", lambda: (
            ("split_axis and concat_axis", (split_axis, concat_axis)),
            ("split_sizes", split_sizes and tuple(int(n) for n in split_sizes)),
            *_block_fields(x, concat_axis, concat_sizes, "concat_sizes")), error)
        return exchange(x)

    @fails_together
    def all_to_all_rows(self, x, send_rows: Sequence[int],
                        recv_rows: Sequence[int] | None = None):
        """Rows of ``x`` sent in blocks, ``send_rows[j]`` of them (in order) to rank j, as a
        mixture of experts sends tokens: returns (what every rank sent this one, stacked in
        rank order, the rows that came from each rank). The counts go first (one all_to_all
        of one integer per rank), then the rows; ``recv_rows``, when the caller knows them
        (the way back of an exchange), saves the first."""
        send = [int(n) for n in send_rows]
        error = None
        if len(send) != self.size or sum(send) != x.shape[0] or min(send, default=0) < 0:
            error = HpcparError(f"all_to_all_rows on {self.name}: send_rows {send} must give "
                                f"each of the {self.size} ranks a count >= 0 summing to the "
                                f"{x.shape[0]} rows of x")
        self._agree("all_to_all_rows", lambda: _array_fields(x, 0), error)
        checking = active(self)
        if recv_rows is None or checking:
            recv = self.on_host().all_to_all(np.asarray(send, dtype=np.int64).reshape(-1, 1),
                                             0, 1).reshape(-1).tolist()
        if recv_rows is not None:
            given = [int(n) for n in recv_rows]
            if checking:         # MPI would cut a longer block, or leave rows unwritten
                mismatch = None if given == recv else HpcparError(
                    f"recv_rows {given}, where the ranks send {recv} rows")
                self._agree("all_to_all_rows", lambda: [], mismatch)
            recv = given
        row = math.prod(x.shape[1:])
        out = self.xp.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype)
        if self.size == 1:
            out[...] = x
            return out, recv
        # the bytes that leave this rank (its own block stays)
        nbytes = (sum(send) - send[self.rank]) * row * np.dtype(x.dtype).itemsize
        self._run("all_to_all", nbytes, self._all_to_all,
                  self.xp.ascontiguousarray(x).reshape(-1), [n * row for n in send],
                  out.reshape(-1), [n * row for n in recv], True)
        return out, recv

    # ---- prepared operations --------------------------------------------------------------
    # A collective worked out once for operands of one shape and dtype: the lengths, counts
    # and layouts checked and computed when it is made, so a loop that repeats it (a
    # redistribution, a layer's gather) pays only for the allocation and the transfer. The
    # public methods above are these plus the agreement check; the caller of an ``*_op``
    # itself passes operands of the shape and dtype it was made for, alike on every rank.

    def all_gather_op(self, shape, dtype, axis: int = 0, sizes=None) -> Callable:
        """``all_gather`` of arrays of ``shape`` and ``dtype``: a function ``(x, out=None)``."""
        return self._op("all_gather", self._make_all_gather, tuple(shape), dtype, axis,
                        _key(sizes))

    def reduce_scatter_op(self, shape, dtype, axis: int = 0, sizes=None) -> Callable:
        """``reduce_scatter`` of arrays of ``shape`` and ``dtype``: ``(x, out=None)``."""
        return self._op("reduce_scatter", self._make_reduce_scatter, tuple(shape), dtype, axis,
                        _key(sizes))

    def all_to_all_op(self, shape, dtype, split_axis: int, concat_axis: int,
                      split_sizes=None, concat_sizes=None) -> Callable:
        """``all_to_all`` of arrays of ``shape`` and ``dtype``: a function ``(x)``."""
        return self._op("all_to_all", self._make_all_to_all, tuple(shape), dtype, split_axis,
                        concat_axis, _key(split_sizes), _key(concat_sizes))

    def _op(self, name: str, make, *key):
        """The prepared operation for ``key``, made once (bad input raises every time). The
        operations hold their communicator weakly: kept in its own table, they
        would otherwise make it a cycle that only Python's cycle collector frees, staging
        buffers and MPI communicator included."""
        op = self._ops.get((name, *key))
        if op is None:
            if len(self._ops) >= 4096:                   # shapes that never repeat
                self._ops.clear()
            op = self._ops[(name, *key)] = make(*key)
        return op

    def _make_all_gather(self, shape: tuple, dtype, axis: int, sizes) -> Callable:
        axis = _normalize_axis(axis, len(shape))
        lengths = self._block_sizes(sizes, shape[axis], "all_gather")
        result_shape = _with_length(shape, axis, sum(lengths))
        per_index = math.prod(_with_length(shape, axis, 1))
        counts = [n * per_index for n in lengths]
        total = math.prod(result_shape)
        nbytes = total * np.dtype(dtype).itemsize
        xp = self.xp
        me = weakref.proxy(self)                          # held weakly: see _op

        def gather(x, out=None):
            _check_out(out, result_shape, dtype)
            send = xp.ascontiguousarray(x).reshape(-1)     # rank r's block: its whole x
            landing = me._landing(out, result_shape, dtype) if axis == 0 \
                else xp.empty(total, dtype=dtype)
            if me.size == 1:
                landing.reshape(-1)[...] = send
            else:
                me._run("all_gather", nbytes, me._all_gather, send, landing.reshape(-1),
                        counts)
            if axis == 0:              # the blocks stacked along the first axis: in place
                return _into(out, landing)
            result = out if out is not None else xp.empty(result_shape, dtype=dtype)
            _unpack_blocks(landing, result, axis, shape, lengths)
            return result
        gather.result_shape = result_shape
        return gather

    def _make_reduce_scatter(self, shape: tuple, dtype, axis: int, sizes) -> Callable:
        axis = _normalize_axis(axis, len(shape))
        n = shape[axis]
        if sizes is None:
            sizes = split_sizes(n, self.size)
        elif len(sizes) != self.size or sum(sizes) != n:
            raise HpcparError(f"reduce_scatter on {self.name}: sizes {list(sizes)} do not "
                              f"cut a length of {n} into {self.size} blocks")
        sizes = [int(s) for s in sizes]
        block_shape = _with_length(shape, axis, sizes[self.rank])
        per_index = math.prod(_with_length(shape, axis, 1))
        counts = [s * per_index for s in sizes]
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        me = weakref.proxy(self)                          # held weakly: see _op

        def scatter(x, out=None):
            _check_out(out, block_shape, dtype)
            send = me._pack_blocks(x, axis, sizes)            # flat: block r, then r + 1
            block = me._landing(out, block_shape, dtype)
            if me.size == 1:
                block.reshape(-1)[...] = send
            else:
                me._run("reduce_scatter", nbytes, me._reduce_scatter, send,
                        block.reshape(-1), counts)
            return _into(out, block)
        scatter.result_shape = block_shape
        return scatter

    def _make_all_to_all(self, shape: tuple, dtype, split_axis: int, concat_axis: int,
                         split_sizes, concat_sizes) -> Callable:
        split_axis, concat_axis, cut, theirs = self._all_to_all_blocks(
            shape, split_axis, concat_axis, split_sizes, concat_sizes)
        per_step = math.prod(_with_length(shape, split_axis, 1))   # elements per split index
        mine = cut[self.rank]

        def arriving(t: int) -> tuple:
            """The shape of a block from a rank holding ``t`` along the concat axis."""
            return tuple(mine if a == split_axis else t if a == concat_axis else n
                         for a, n in enumerate(shape))

        send_counts = [n * per_step for n in cut]
        recv_counts = [math.prod(arriving(t)) for t in theirs]
        result_shape, block_shape = arriving(sum(theirs)), arriving(0)
        nbytes = (sum(recv_counts) + math.prod(shape)) * np.dtype(dtype).itemsize
        xp = self.xp
        me = weakref.proxy(self)                          # held weakly: see _op

        def exchange(x):
            send = me._pack_blocks(x, split_axis, cut)    # flat: block j, then block j + 1
            recv = xp.empty(sum(recv_counts), dtype=dtype)
            if me.size == 1:
                recv[...] = send
            else:
                me._run("all_to_all", nbytes, me._all_to_all, send, send_counts, recv,
                        recv_counts)
            if concat_axis == 0:       # blocks stacked along the first axis: already in place
                return recv.reshape(result_shape)
            out = xp.empty(result_shape, dtype=dtype)
            _unpack_blocks(recv, out, concat_axis, block_shape, theirs)
            return out
        exchange.result_shape = result_shape
        return exchange

    def _pack_blocks(self, x, axis: int, cut: list[int]):
        """``x`` cut along ``axis`` into blocks of ``cut`` lengths, laid one after the other
        in a flat buffer: no copy along the first axis, else one pass over ``x``."""
        xp = self.xp
        if axis == 0:
            return xp.ascontiguousarray(x).reshape(-1)
        if len(set(cut)) == 1:          # (..., p, n / p, ...) with the p axis moved first
            split = x.reshape(x.shape[:axis] + (len(cut), cut[0]) + x.shape[axis + 1:])
            order = (axis,) + tuple(a for a in range(split.ndim) if a != axis)
            return xp.ascontiguousarray(split.transpose(order)).reshape(-1)
        out = xp.empty(x.size, dtype=x.dtype)
        index = [slice(None)] * x.ndim
        start = offset = 0
        for n in cut:
            index[axis] = slice(start, start + n)
            block = x[tuple(index)]
            out[offset:offset + block.size].reshape(block.shape)[...] = block
            start, offset = start + n, offset + block.size
        return out

    def _all_to_all_blocks(self, shape, split_axis, concat_axis, split_sizes, concat_sizes):
        """The axes (normalized), the lengths cut along the split axis and those coming
        from each rank along the concat axis, or the bad input."""
        split_axis = _normalize_axis(split_axis, len(shape))
        concat_axis = _normalize_axis(concat_axis, len(shape))
        if split_axis == concat_axis:
            raise HpcparError("all_to_all: split_axis and concat_axis must differ")
        n_split = shape[split_axis]
        cut = [int(s) for s in split_sizes] if split_sizes is not None else None
        if cut is None:
            if n_split % self.size:
                raise HpcparError(f"all_to_all on {self.name}: length {n_split} along axis "
                                  f"{split_axis} does not split over {self.size} ranks; pass "
                                  f"split_sizes")
            cut = [n_split // self.size] * self.size
        theirs = ([int(s) for s in concat_sizes] if concat_sizes is not None
                  else [shape[concat_axis]] * self.size)
        if len(cut) != self.size or sum(cut) != n_split or len(theirs) != self.size \
                or theirs[self.rank] != shape[concat_axis]:
            raise HpcparError(f"all_to_all on {self.name}: split_sizes {cut} / concat_sizes "
                              f"{theirs} do not fit {self.size} ranks and local shape "
                              f"{tuple(shape)}")
        return split_axis, concat_axis, cut, theirs

    def _landing(self, out, shape: tuple, dtype):
        """Where a contiguous result is written: ``out`` itself when it can take it."""
        if out is not None and out.flags.c_contiguous:
            return out
        return self.xp.empty(shape, dtype=dtype)

    def _place(self, front, axis: int, out):
        """The result in its final layout: ``out`` if given, else a contiguous array."""
        if out is None:
            return self.xp.ascontiguousarray(_from_front(front, axis))
        if front is not out:
            out[...] = _from_front(front, axis)
        return out

    @fails_together
    def gather(self, x, root: int = 0, axis: int = 0, sizes: Sequence[int] | None = None):
        """Every rank's ``x`` concatenated along ``axis`` in rank order, on ``root`` only
        (other ranks get None). Blocks may differ in length along ``axis``: pass every rank's
        length as ``sizes`` (0 for a rank with nothing to give)."""
        try:
            axis = _normalize_axis(axis, x.ndim)
            front = self.xp.ascontiguousarray(_to_front(x, axis))
            lengths = self._block_sizes(sizes, front.shape[0], "gather")
            error = None
        except HpcparError as e:
            error = e
        self._agree("gather", lambda: (("root", root), *_block_fields(x, axis, sizes)), error)
        gathered = None
        if self.rank == root:
            gathered = self.xp.empty((sum(lengths),) + front.shape[1:], dtype=x.dtype)
        if self.size == 1:
            gathered[...] = front
        else:
            nbytes = gathered.nbytes if gathered is not None else front.nbytes
            self._run("gather", nbytes, self._gather, front, gathered, lengths, root)
        return None if gathered is None else self._place(gathered, axis, None)

    @fails_together
    def scatter(self, x, out, root: int = 0, axis: int = 0):
        """``root``'s ``x`` cut along ``axis`` into consecutive blocks, block i to rank i, into
        every rank's ``out`` (whose length along ``axis`` says how much that rank takes; the
        lengths must add up to root's). ``x`` is read on root only; returns ``out``."""
        _require_contiguous(out, "scatter")
        axis = _normalize_axis(axis, out.ndim)
        block_shape = _to_front(out, axis).shape
        front = None
        if self.rank == root:
            front = self.xp.ascontiguousarray(_to_front(x, axis))
        # every rank learns every block's length and root's, so all agree on a mismatch
        mine = [block_shape[0], math.prod(block_shape[1:]), -1, -1]
        if front is not None:
            mine[2:] = [front.shape[0], math.prod(front.shape[1:])]
        table = self._all_rows(mine)
        sizes = [int(r[0]) for r in table]
        total, rest = (int(v) for v in table[root][2:])
        if sum(sizes) != total or any(int(r[1]) != rest for r in table):
            raise HpcparError(f"scatter on {self.name}: root's array does not split into the "
                              f"blocks {sizes} along axis {axis} (root has {total} there)")
        block = out if axis == 0 else self.xp.empty(block_shape, out.dtype)
        if self.size == 1:
            block[...] = front
        else:
            nbytes = front.nbytes if front is not None else block.nbytes
            self._run("scatter", nbytes, self._scatter, front, block, sizes, root)
        if block is not out:
            out[...] = _from_front(block, axis)
        return out

    @fails_together
    def reduce(self, x, root: int = 0, op: str = "sum"):
        """x <- sum (or max) of x over the group on ``root``, in place; other ranks' x is
        left as it was. Returns x."""
        error = None if op in REDUCE_OPS else HpcparError(
            f"reduce: op {op!r} is not one of {', '.join(REDUCE_OPS)}")
        if self.size == 1 and error is None:
            return x
        self._agree("reduce", lambda: (("root", root), ("op", op), *_array_fields(x)), error)
        return self._in_place("reduce", x, self._reduce, root, op, result=self.rank == root)

    def _in_place(self, op: str, x, primitive, *args, result: bool = True):
        """``primitive(buf, *args)`` on ``x`` made contiguous (at most one copy), the outcome
        written back into ``x`` where this rank gets one (``result``); returns x."""
        buf = self.xp.ascontiguousarray(x)
        self._run(op, buf.nbytes, primitive, buf, *args)
        if buf is not x and result:
            x[...] = buf
        return x

    def _block_sizes(self, sizes, n_local: int, op: str) -> list[int]:
        if sizes is None:
            return [n_local] * self.size
        if len(sizes) != self.size or sizes[self.rank] != n_local:
            raise HpcparError(f"{op} on {self.name}: sizes {list(sizes)} do not match "
                              f"{self.size} ranks with local length {n_local} on rank "
                              f"{self.rank}")
        return list(sizes)

    def _all_rows(self, row: list[int]):
        """Every rank's small integer ``row``, as a host table (size, len(row)): metadata,
        so it goes over the host twin and never visits the device."""
        mine = np.asarray([row], dtype=np.int64)
        return mine if self.size == 1 else self.on_host().all_gather(mine)

    @fails_together
    def broadcast(self, x, root: int = 0):
        """x <- root's x, in place; returns x."""
        if self.size == 1:
            return x
        self._agree("broadcast", lambda: (("root", root), *_array_fields(x)))
        return self._in_place("broadcast", x, self._broadcast, root)

    @fails_together
    def isend(self, x, dest: int, tag: int = 0) -> Request:
        """Start sending ``x`` to group rank ``dest``; do not modify ``x`` before ``wait()``."""
        buf = self.xp.ascontiguousarray(x)
        return self._run("send", buf.nbytes, self._isend, buf, dest, tag)

    @fails_together
    def irecv(self, out, source: int, tag: int = 0) -> Request:
        """Start receiving into ``out`` (contiguous, preallocated) from group rank ``source``."""
        _require_contiguous(out, "irecv")
        return self._run("recv", out.nbytes, self._irecv, out, source, tag)

    @fails_together
    def send(self, x, dest: int, tag: int = 0) -> None:
        self.isend(x, dest, tag).wait()

    @fails_together
    def recv(self, out, source: int, tag: int = 0):
        self.irecv(out, source, tag).wait()
        return out

    @fails_together
    def sendrecv(self, x, dest: int, out, source: int, tag: int = 0):
        """Send ``x`` to ``dest`` while receiving ``out`` from ``source``; returns ``out``."""
        _require_contiguous(out, "sendrecv")
        buf = self.xp.ascontiguousarray(x)
        self._run("sendrecv", buf.nbytes + out.nbytes, self._sendrecv, buf, dest, out, source, tag)
        return out

    @fails_together
    def barrier(self) -> None:
        self._run("barrier", 0, self._barrier)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _agree(self, op: str, fields: Callable[[], tuple],
               error: HpcparError | None = None) -> None:
        """Every rank passes the same ``fields()`` to ``op`` (when this group checks now:
        the fields are made only then), and ``error``, this rank's bad input, is raised on
        every rank (or on this one)."""
        if active(self):
            agree(self, f"{op} on the {self.name} group", fields(), error)
        elif error is not None:
            agree(self, op, (), error)        # raises it (agreed where this rank is all)

    @fails_together
    def agree(self, what: str, fields, error: Exception | None = None) -> None:
        """Raise ``Disagreement`` on every rank unless all pass equal ``fields`` (labelled
        values); one small all-reduce when this group checks, nothing otherwise. ``error``:
        this rank's own bad input, raised on every rank."""
        agree(self, what, fields, error)

    def _run(self, op: str, nbytes: int, primitive, *args):
        """Call ``primitive``, recording bytes and time, naming op and group if it fails."""
        clock = self._device_clock()
        begin = perf_counter()
        start = begin if clock is None else clock.now()
        try:
            result = primitive(*args)
        except (HpcparError, Stopped):      # a peer's failure, a stop request: as they are
            raise
        except Exception as e:
            raise CommError(f"{op} on the {self.name} group ({self.size} ranks, this is group "
                            f"rank {self.rank}) failed: {type(e).__name__}: {e}") from e
        end, name = perf_counter(), f"{self.name}.{op}"
        if clock is None:
            self.stats.record(name, nbytes, end - start)
        else:
            self.stats.record_on(clock, name, nbytes, start)
        if isinstance(result, Request):          # traced where it is waited for
            result.label, result.nbytes = name, nbytes
        elif (tracer := trace.current()) is not None:
            tracer.add(name, "comm", begin, end, {"bytes": nbytes})
        return result

    def _device_clock(self):
        """A ``DeviceClock`` where operations are queued on the device rather than done when
        the call returns (NCCL); None where host time is the operation's time."""
        return None

    # ---- what an implementation provides (contiguous buffers only) ------------------------

    @abstractmethod
    def _over_mpi(self, mpi_comm, backend: ArrayBackend, name: str) -> "Communicator":
        """An MPI communicator over ``mpi_comm`` with this one's stats and timeout (for
        ``on_host`` and ``split``: the subclasses know the MPI class, this module does not)."""

    @abstractmethod
    def _all_reduce(self, buf, op: str) -> None: ...

    @abstractmethod
    def _iall_reduce(self, buf) -> Request:
        """Start a sum over the group, in place."""

    @abstractmethod
    def _all_gather(self, send, recv, sizes: list[int]) -> None:
        """recv (n_total, *rest) <- every rank's send (sizes[r], *rest), in rank order."""

    @abstractmethod
    def _iall_gather(self, send, recv, sizes: list[int]) -> Request:
        """Start ``_all_gather`` of flat buffers; the request completes it."""

    @abstractmethod
    def _reduce_scatter(self, send, recv, sizes: list[int]) -> None:
        """recv (sizes[rank], *rest) <- this rank's block of the sum of send (n, *rest)."""

    @abstractmethod
    def _gather(self, send, recv, sizes: list[int], root: int) -> None:
        """recv (n_total, *rest) on root <- every rank's send (sizes[r], *rest), rank order;
        recv is None on the other ranks."""

    @abstractmethod
    def _scatter(self, send, recv, sizes: list[int], root: int) -> None:
        """recv (sizes[rank], *rest) <- block ``rank`` of root's send; send is None off root."""

    @abstractmethod
    def _reduce(self, buf, root: int, op: str) -> None:
        """buf on root <- the sum (max) of every rank's buf."""

    @abstractmethod
    def _broadcast(self, buf, root: int) -> None: ...

    @abstractmethod
    def _all_to_all(self, send, send_counts: list[int], recv,
                    recv_counts: list[int], uneven: bool = False) -> None:
        """Flat buffers: block j of ``send`` (``send_counts[j]`` elements, in order) to rank
        j; block j of ``recv`` from rank j. ``uneven``: the ranks' counts may differ, so no
        rank may take a path of equal blocks on its own (MPI's Alltoall and Alltoallv do
        not match each other)."""

    @abstractmethod
    def _isend(self, buf, dest: int, tag: int) -> Request: ...

    @abstractmethod
    def _irecv(self, buf, source: int, tag: int) -> Request: ...

    @abstractmethod
    def _sendrecv(self, send, dest: int, recv, source: int, tag: int) -> None: ...

    @abstractmethod
    def _barrier(self) -> None: ...


def _attempt(make, x, *args, out=None):
    """(the operation ``make`` prepares for ``x`` and ``out``, None), or (None, the bad
    input): bad input is found before the ranks agree, so that every rank raises it."""
    try:
        op = make(x.shape, x.dtype, *args)
        if out is not None:
            _check_out(out, op.result_shape, x.dtype)
        return op, None
    except HpcparError as e:
        return None, e


def _key(sizes):
    """Block lengths as a hashable key (None: the default)."""
    return None if sizes is None else tuple(int(n) for n in sizes)


def _array_fields(x, free_axis: int | None = None) -> tuple:
    """An operand's shape and dtype as agreement fields; ``free_axis`` (an index as the
    caller passed it) may differ in length between the ranks."""
    shape: tuple = tuple(int(n) for n in x.shape)
    if free_axis is not None and -len(shape) <= free_axis < len(shape):
        i = free_axis % len(shape)
        shape = shape[:i] + ("*",) + shape[i + 1:]
    return ("shape", shape), ("dtype", dtype_name(x.dtype))


def _block_fields(x, axis: int, sizes, name: str = "sizes") -> tuple:
    """Fields of a collective over blocks along ``axis``: without ``sizes`` every rank's
    array must be the same; with them, the same ``sizes``, and any length along the axis
    (each rank's own is checked against its entry locally)."""
    if sizes is None:
        return ("axis", axis), *_array_fields(x)
    return ("axis", axis), (name, tuple(int(s) for s in sizes)), *_array_fields(x, axis)


def _with_length(shape, axis: int, n: int) -> tuple:
    """``shape`` with ``n`` along ``axis``."""
    return tuple(shape[:axis]) + (n,) + tuple(shape[axis + 1:])


def _check_out(out, shape: tuple, dtype) -> None:
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype):
        raise HpcparError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                          f"the result needs {tuple(shape)} and {dtype}")


def _into(out, result):
    """``result``, copied into ``out`` when the caller gave one it was not written into."""
    if out is None or result is out:
        return result
    out[...] = result
    return out


def _unpack_blocks(flat, out, axis: int, shape, lengths) -> None:
    """Blocks laid one after the other in ``flat`` (block j: ``shape`` with ``lengths[j]``
    along ``axis``) placed side by side along ``axis`` of ``out``: one pass."""
    if len(set(lengths)) == 1 and out.flags.c_contiguous:     # one strided copy, not p
        n, p = lengths[0], len(lengths)
        blocks = flat.reshape((p,) + _with_length(shape, axis, n))
        order = tuple(range(1, axis + 1)) + (0,) + tuple(range(axis + 1, len(shape) + 1))
        out.reshape(tuple(shape[:axis]) + (p, n) + tuple(shape[axis + 1:]))[...] = \
            blocks.transpose(order)
        return
    index = [slice(None)] * len(shape)
    start = offset = 0
    for n in lengths:
        block_shape = _with_length(shape, axis, n)
        count = math.prod(block_shape)
        index[axis] = slice(start, start + n)
        out[tuple(index)] = flat[offset:offset + count].reshape(block_shape)
        start, offset = start + n, offset + count


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise HpcparError(f"axis {axis} is out of range for an array of {ndim} dimensions")
    return axis % ndim


def _to_front(x, axis: int):
    """View of ``x`` with ``axis`` first (a transpose; np.moveaxis costs more per call)."""
    if axis == 0:
        return x
    return x.transpose((axis,) + tuple(i for i in range(x.ndim) if i != axis))


def _from_front(x, axis: int):
    """Inverse of ``_to_front``: move the first axis back to position ``axis``."""
    if axis == 0:
        return x
    return x.transpose(tuple(range(1, axis + 1)) + (0,) + tuple(range(axis + 1, x.ndim)))


def _require_contiguous(a, op: str) -> None:
    if not a.flags.c_contiguous:
        raise HpcparError(f"{op}: the receive buffer must be C-contiguous "
                          f"(shape {a.shape}); allocate it with empty() and copy afterwards")
