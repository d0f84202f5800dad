"""ZeRO stages 2 and 3 (``--zero 2``, ``--zero 3``): the gradients, and with stage 3 the
weights, split over the data-parallel replicas one *unit* at a time.

A unit is a group of parameters whose gradients complete together in the backward (a decoder
layer, the final norm: ``ModelChunk.groups``; the head and the embedding each alone,
``_unit_lists``), the unit FSDP and DeepSpeed shard by. Its parameters lie end to end in one flat layout, cut into dp consecutive
pieces as ``Communicator.reduce_scatter`` cuts it. This rank keeps its piece of the float32
master weights and of the summed gradients, and the optimizer steps those pieces only (one
``Param`` *segment* per parameter piece, as ZeRO-1's ``zero.ZeroShards``):

    loading (stage 3)          this rank's pieces of the master weights (and, resuming, of
                               the optimizer state) read alone (``PieceReader``)
    a micro-batch's backward   the unit's gradients go to a whole buffer opened when the
                               first is written (not added to zeros); when its group is
                               complete they are reduce-scattered into this rank's piece,
                               and the buffer is given back
    the optimizer step         on this rank's segments
    stage 2, after the step    every rank's piece of the compute weights all-gathered into
                               the full compute copy each rank keeps
    stage 3                    no full copy kept: a unit's compute weights are gathered from
                               the pieces just before its forward, and again before its
                               backward, and dropped after; the next layer's gather is issued
                               ahead so it overlaps this one's compute

In 16 bits the pieces' compute copy is cast from the float32 masters after each step, so the
gathers move 16-bit weights. The gradients are reduce-scattered every micro-batch (DeepSpeed's
stage 2, FSDP2's default): a full gradient of the model is never held.

Arrays not held stand as ``NotHeld`` placeholders, which say what happened if used.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from ...checkpoint.reader import PieceReader
from ...models.tensors import EMBED, LM_HEAD
from ...parallel.comm import Communicator, Request, split_sizes
from ...parallel.data_parallel.flat_buffers import Flat
from ...parallel.errors import HpcparError
from .checkpoint import OPTIMIZER_GROUP
from .params import NotHeld, Param


class Transient:
    """The micro-batches' gathered weights and whole gradients: buffers given back and taken
    again by size and dtype (every layer's are alike, and the embedding's and the head's),
    so each step reuses the same few instead of faulting fresh pages in (a caching
    allocator's role), and counted: ``nbytes`` is all it ever made."""

    def __init__(self, xp):
        self.xp = xp
        self.free: dict[tuple, list] = {}
        self.made = 0

    def take(self, n: int, dtype):
        kept = self.free.get((n, np.dtype(dtype)))
        if kept:
            return kept.pop()
        self.made += n * np.dtype(dtype).itemsize
        return self.xp.empty(n, dtype=dtype)

    def give(self, buf) -> None:
        self.free.setdefault((buf.size, np.dtype(buf.dtype)), []).append(buf)

    def nbytes(self) -> int:
        return self.made


@dataclass(eq=False)
class Unit:
    """One unit's layout and this rank's pieces of it (views into the group's flat buffers)."""

    params: list[Param]
    comm: Communicator
    offsets: list[int]            # each param's start in the unit's flat layout, then the end
    sizes: list[int]              # every rank's piece length
    grad_piece: object = None     # float32: this rank's piece of the summed gradients
    master_piece: object = None   # float32: this rank's piece of the master weights
    data_piece: object = None     # compute dtype: its copy the gathers send
    data: object = None           # the full compute weights: stage 2 always, 3 while in use
    grads: object = None          # the full gradients while a micro-batch's are added
    gathering: Request | None = None
    written: set = field(default_factory=set)   # params whose gradient is in ``grads``
    users: int = 0
    index: int = field(default=0)

    @property
    def size(self) -> int:
        return self.offsets[-1]

    @property
    def lo(self) -> int:
        return sum(self.sizes[:self.comm.rank])

    def views(self, buf) -> list:
        """Each param's array as a view of the full flat ``buf``."""
        return [buf[a:b].reshape(p.data.shape)
                for p, a, b in zip(self.params, self.offsets, self.offsets[1:])]


class ShardedUnits:
    """Stage 2 or 3 over the params of ``groups`` (lists in the order their gradients
    complete: the units, ``_unit_lists``) held by the ranks of ``comm``. ``segments`` are
    what the optimizer steps; ``offset[name]``: where a param's segment starts in it."""

    def __init__(self, comm: Communicator, groups: list[list[Param]], xp, dtype, stage: int,
                 transient: Transient, reader: PieceReader | None = None):
        """``reader``: where the pieces of params loaded as ``NotHeld`` are read from (stage
        3 loads no whole weights)."""
        self.comm, self.xp, self.stage, self.transient = comm, xp, stage, transient
        self.reader = reader
        self.dtype = np.dtype(dtype)
        self.units = [Unit(g, comm, _offsets(g), split_sizes(_offsets(g)[-1], comm.size),
                           index=i) for i, g in enumerate(_unit_lists(groups))]
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.segments: list[Param] = []
        self.offset: dict[str, int] = {}
        self._cut_pieces()
        if stage == 2:
            self._keep_full_copy()
        for u in self.units:
            for p in u.params:
                p.master = None                      # the pieces hold it now
                p.grad = NotHeld("gradient", p.name, p.data.shape, np.float32)
                if stage == 3:
                    p.data = NotHeld("weights", p.name, p.data.shape, self.dtype)

    # ---- making -------------------------------------------------------------------------

    def _cut_pieces(self) -> None:
        """The segments: this rank's piece of every unit, its masters copied from the params'
        full float32 weights, laid end to end in three buffers (gradients, masters and, in
        16 bits, their compute copy)."""
        found = []                       # (unit, param, start in it, end in it)
        for u in self.units:
            lo = u.lo
            hi = lo + u.sizes[self.comm.rank]
            for p, a, b in zip(u.params, u.offsets, u.offsets[1:]):
                if max(a, lo) < min(b, hi):
                    found.append((u, p, max(a, lo) - a, min(b, hi) - a))
        shapes = [(c - a,) for _, _, a, c in found]
        grads = Flat(self.xp, shapes, np.float32)
        masters = Flat(self.xp, shapes, np.float32, zero=False)
        compute = (masters if self.dtype == np.float32
                   else Flat(self.xp, shapes, self.dtype, zero=False))
        by_unit: dict[int, list[int]] = {}
        for i, (u, p, a, c) in enumerate(found):
            masters.views[i][...] = (self.xp.asarray(self.reader.read(p.spec, a, c))
                                     if isinstance(p.master, NotHeld)
                                     else p.master.reshape(-1)[a:c])
            self.offset[p.name] = a
            self.segments.append(Param(p.spec, masters.views[i], grads.views[i], p.counted,
                                       p.decay, p.kv_replicated, tp_partial=p.tp_partial))
            by_unit.setdefault(u.index, []).append(i)
        for u in self.units:
            mine = by_unit.get(u.index, [])
            span = (mine[0], mine[-1] + 1) if mine else (0, 0)
            u.grad_piece, u.master_piece, u.data_piece = (
                f.span(*span) if mine else self.xp.empty(0, f.buffer.dtype)
                for f in (grads, masters, compute))
            if compute is masters:                 # float32: the masters are the copy
                u.data_piece = u.master_piece
        grads.place(self.segments, "grad")
        masters.place(self.segments, "master")
        self.refresh_pieces()

    def _keep_full_copy(self) -> None:
        """Stage 2: every param's compute weights a view of one buffer, laid out unit after
        unit, so that each unit's gather lands in place."""
        params = [p for u in self.units for p in u.params]
        full = Flat(self.xp, [p.data.shape for p in params], self.dtype, zero=False)
        at = 0
        for u in self.units:
            u.data = full.buffer[full.offsets[at]:full.offsets[at + len(u.params)]]
            for p, view in zip(u.params, u.views(u.data)):
                view[...] = p.data
                p.data = view
            at += len(u.params)

    # ---- the step -----------------------------------------------------------------------

    def open(self, u: Unit) -> None:
        """The unit's full gradient buffer bound to its params; not zeroed: a param's first
        gradient is written (``ZeroHooks.adding``), one never written zeroed at ``close``."""
        u.grads = self.transient.take(u.size, np.float32)
        u.written = set()
        for p, view in zip(u.params, u.views(u.grads)):
            p.grad = view

    def close(self, u: Unit) -> None:
        """This micro-batch's gradients of the unit summed over the replicas into this
        rank's piece; the full buffer given back."""
        if u.grads is None:
            return
        for p in u.params:
            if id(p) not in u.written:
                p.grad[...] = 0
        # the piece summed so far joins this rank's block of the sum: no buffer between
        lo = u.lo
        u.grads[lo:lo + u.sizes[self.comm.rank]] += u.grad_piece
        self.comm.reduce_scatter(u.grads, out=u.grad_piece, sizes=u.sizes)
        self.transient.give(u.grads)
        u.grads = None
        for p in u.params:
            p.grad = NotHeld("gradient", p.name, p.data.shape, np.float32)

    def close_all(self) -> None:
        for u in self.units:
            self.close(u)

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_piece[...] = 0

    def refresh_pieces(self) -> None:
        """The compute copy of this rank's pieces, from the updated masters."""
        for u in self.units:
            if u.data_piece is not u.master_piece:
                u.data_piece[...] = u.master_piece

    def all_gather(self) -> None:
        """Stage 2, after the step: every rank's updated piece into the full compute copy."""
        self.refresh_pieces()
        if self.stage == 2:
            for u in self.units:
                self.comm.all_gather(u.data_piece, sizes=u.sizes, out=u.data)

    # ---- stage 3: the weights gathered where they are used ------------------------------

    def start_gather(self, u: Unit) -> None:
        """Issue the unit's gather (it completes in ``acquire``)."""
        if u.data is None and u.gathering is None:
            u.data = self.transient.take(u.size, self.dtype)
            u.gathering = self.comm.iall_gather(u.data_piece, u.sizes, u.data)

    def acquire(self, u: Unit) -> None:
        self.start_gather(u)
        if u.gathering is not None:
            u.gathering.wait()
            u.gathering = None
            for p, view in zip(u.params, u.views(u.data)):
                p.data = view
        u.users += 1

    def release(self, u: Unit) -> None:
        u.users -= 1
        if u.users == 0:
            self.transient.give(u.data)
            u.data = None
            for p in u.params:
                p.data = NotHeld("weights", p.name, p.data.shape, self.dtype)

    def slice_state(self, full: dict[str, dict], names) -> dict[str, dict]:
        """Per-param optimizer state (states ``names``) cut to the segments: from the whole
        state (as a checkpoint holds it) in ``full``, or read alone where not there."""
        out = {}
        for seg in self.segments:
            a = self.offset[seg.name]
            c = a + seg.master.size
            if seg.name in full:
                out[seg.name] = {k: v.reshape(-1)[a:c].copy() for k, v in full[seg.name].items()}
            else:
                out[seg.name] = {k: self.xp.asarray(self.reader.read(
                    seg.spec, a, c, f"{OPTIMIZER_GROUP}/{{}}/{k}")) for k in names}
        return out


class ZeroHooks:
    """What the model chunks and the backward call, over every group's ``ShardedUnits`` (a
    MoE layer's experts are held by other replicas than its dense weights: two units).

    ``use(params)``: their units' weights gathered for the duration (stage 3; nothing
    otherwise); ``prefetch(params)``: their gathers issued now; ``adding(param)``: its unit's
    gradient buffer open before a gradient is added; ``done(params)``: their units' gradients
    complete for this micro-batch."""

    def __init__(self, sharded: list[ShardedUnits]):
        self.sharded = sharded
        self.unit_of = {pid: (s, u) for s in sharded for pid, u in s.unit_of.items()}
        self.gathers = any(s.stage == 3 for s in sharded)

    def _units(self, params) -> list[tuple[ShardedUnits, Unit]]:
        out, seen = [], set()
        for p in params:
            found = self.unit_of.get(id(p))
            if found is not None and id(found[1]) not in seen:
                seen.add(id(found[1]))
                out.append(found)
        return out

    @contextlib.contextmanager
    def use(self, params):
        if not self.gathers:
            yield
            return
        units = [(s, u) for s, u in self._units(params) if s.stage == 3]
        for s, u in units:
            s.acquire(u)
        try:
            yield
        finally:
            for s, u in units:
                s.release(u)

    def prefetch(self, params) -> None:
        if self.gathers:
            for s, u in self._units(params):
                if s.stage == 3:
                    s.start_gather(u)

    def adding(self, param) -> bool:
        """``param``'s unit open for its gradient; True for its first this micro-batch (the
        caller writes it: the buffer is not zeroed)."""
        found = self.unit_of.get(id(param))
        if found is None:
            return False
        sharded, unit = found
        if unit.grads is None:
            sharded.open(unit)
        if id(param) in unit.written:
            return False
        unit.written.add(id(param))
        return True

    def done(self, params) -> None:
        for s, u in self._units(params):
            s.close(u)

    def finish(self) -> None:
        """End of the backward: every unit still open summed (in unit order on every rank)."""
        for s in self.sharded:
            s.close_all()


def check_alike(sharded: list[ShardedUnits], tp: Communicator | None) -> None:
    """Gradients summed over tp ranks (a KV head several hold, a per-head norm) are summed
    piece by piece after the reduce-scatters: their units must be cut alike on every tp rank
    (they are whenever tp divides the heads evenly; refused in one line otherwise)."""
    if tp is None or tp.size == 1 or not any(
            p.kv_replicated or p.tp_partial for s in sharded for u in s.units for p in u.params):
        return
    mine = np.array([hash(tuple(tuple(u.sizes) for s in sharded for u in s.units))], np.int64)
    every = tp.on_host().all_gather(mine)
    if len(set(every.tolist())) > 1:
        raise HpcparError("--zero 2 and 3 need the tensor-parallel ranks' layers cut alike, "
                          "and this model's tp slices differ in size: use --zero 1, or a tp "
                          "that divides the heads and features evenly")


class _NoHooks:
    """``ZeroHooks`` without ZeRO 2 or 3: every weight and gradient is held whole."""

    def use(self, params):
        return contextlib.nullcontext()

    def prefetch(self, params) -> None:
        pass


NO_HOOKS = _NoHooks()


def _unit_lists(groups: list[list[Param]]) -> list[list[Param]]:
    """The units: each group's params once (a param in two groups: the first); the
    embedding and the head each alone: a tied embedding's copies on the first and last
    pipeline stage are then cut alike, so their pieces add, and the two vocabulary-sized
    units share their transient buffers."""
    out, seen = [], set()
    for group in groups:
        params = [p for p in group if id(p) not in seen]
        seen.update(id(p) for p in params)
        out += [[p] for p in params if p.spec.name in (EMBED, LM_HEAD)]
        out += [rest] if (rest := [p for p in params if p.spec.name not in (EMBED, LM_HEAD)]) \
            else []
    return out


def _offsets(params: list[Param]) -> list[int]:
    out = [0]
    for p in params:
        out.append(out[-1] + int(np.prod(p.data.shape)))
    return out
