"""Distributed arrays: a local array, the global shape, and a placement per mesh axis.

    x = DArray.from_full(full, mesh, {"x": Shard(0)})      # every rank keeps its piece
    y = x.redistribute({"x": Replicate()})                  # one all-gather
    y.local                                                  # the whole array, every rank

The local array is a plain NumPy or CuPy array; a ``DArray`` only says what it is a piece
of. ``local_bounds`` gives the region of the global array a rank holds (for a ``Partial``
axis, the region of its addend). Nothing here communicates except ``from_local`` without a
shape (one small all-gather of the local lengths) and ``redistribute`` / ``full``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..comm.agreement import trusted
from ..comm.failfast import fails_together
from ..errors import HpcparError
from ..mesh import Mesh
from .piece_layout import (PlacementError, array_fields, attempt, given_key, normalize_placements,
                           piece_bounds, placed, placements_text, shard_chain)
from .placement import Partial, Placement, Replicate, Shard
from .redistribute import Program


class DArray:
    """A distributed array: ``local`` (this rank's array), ``shape`` (the global one), and
    ``placements`` (one per mesh axis). Immutable in what it describes; ``local`` is the
    caller's to read."""

    def __init__(self, local, shape: Sequence[int], mesh: Mesh, placements):
        self.shape = tuple(int(n) for n in shape)
        self.mesh = mesh
        error = None
        try:
            self.placements = placed(mesh, placements, self.shape)
            expected = self.local_shape_at(mesh.coords)
            if tuple(local.shape) != expected:
                raise PlacementError(
                    f"{mesh.describe()}: local array of shape {tuple(local.shape)} is not the "
                    f"piece {expected} of a {self.shape} array placed {self.placement_text()}")
        except HpcparError as e:
            error = e
        if mesh.checking:
            mesh.agree("DArray", array_fields(self.shape, local.dtype,
                                         getattr(self, "placements", placements)), error)
        elif error is not None:
            raise error
        self.local = local

    @classmethod
    def unchecked(cls, local, shape: tuple, mesh: Mesh, placements: tuple) -> "DArray":
        """A DArray the library made itself, whose normalized ``placements`` and ``local``
        piece are known to fit: nothing is checked or exchanged."""
        x = object.__new__(cls)
        x.shape, x.mesh, x.placements, x.local = shape, mesh, placements, local
        return x

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_full(cls, full, mesh: Mesh, placements) -> "DArray":
        """Each rank keeps its piece of ``full`` (the same array on every rank). A ``Partial``
        axis keeps the whole on its coordinate 0 and zeros elsewhere, so the sum is ``full``."""
        placements, error = attempt(placements, placed, mesh, placements, full.shape)
        mesh.agree("DArray.from_full", array_fields(full.shape, full.dtype, placements), error)
        region = piece_bounds(full.shape, mesh.sizes, mesh.coords, placements)
        local = full[tuple(slice(a, b) for a, b in region)]
        backend = mesh.backend
        if isinstance(full, np.ndarray) and backend.on_device:
            local = backend.asarray(np.ascontiguousarray(local))      # host -> device
        else:
            local = local.copy()
        if any(isinstance(p, Partial) and c != 0 for p, c in zip(placements, mesh.coords)):
            local[...] = 0
        with trusted():
            return cls(local, full.shape, mesh, placements)

    @classmethod
    def from_local(cls, local, mesh: Mesh, placements,
                   shape: Sequence[int] | None = None) -> "DArray":
        """Wrap this rank's ``local`` piece. Without ``shape`` the global shape is found by
        one all-gather of every rank's local shape (collective); an even ``Shard`` whose
        pieces differ in length becomes ``Shard(dim, sizes=...)``. Pieces that do not add up
        to one array are an error on every rank."""
        if shape is not None:
            return cls(local, shape, mesh, placements)
        placements, error = attempt(placements, normalize_placements, mesh, placements, local.ndim)
        mesh.agree("DArray.from_local", [("ndim", local.ndim), ("dtype", str(local.dtype)),
                                         ("placements", placements_text(placements))], error)
        with trusted():
            table = mesh.everyone.on_host().all_gather(
                np.asarray([list(mesh.coords) + list(local.shape)], dtype=np.int64))
        naxes = len(mesh.sizes)
        coords = [tuple(int(v) for v in row[:naxes]) for row in table]
        shapes = [tuple(int(v) for v in row[naxes:]) for row in table]
        placements = _infer_sizes(placements, coords, shapes, mesh.sizes)
        shape = _global_shape(placements, coords, shapes, mesh.sizes)
        for c, s in zip(coords, shapes):
            want = tuple(b - a for a, b in piece_bounds(shape, mesh.sizes, c, placements))
            if want != s:
                raise PlacementError(
                    f"from_local: rank {mesh.rank_of(**dict(zip(mesh.axis_names, c)))} holds "
                    f"{s}, which is not its piece {want} of {shape} placed "
                    f"{[repr(p) for p in placements]}")
        with trusted():
            return cls(local, shape, mesh, placements)

    # ---- what it is ---------------------------------------------------------------------------

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def placement_of(self, axis: str) -> Placement:
        return self.placements[self.mesh.axis_index(axis)]

    def local_bounds(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) along each dimension of the region this rank holds."""
        return piece_bounds(self.shape, self.mesh.sizes, self.mesh.coords, self.placements)

    def local_shape_at(self, coords: Sequence[int]) -> tuple[int, ...]:
        return tuple(b - a for a, b in piece_bounds(self.shape, self.mesh.sizes, coords,
                                                    self.placements))

    def agreement_fields(self) -> list:
        """What every rank must hold alike about this array (``Mesh.agree``)."""
        return array_fields(self.shape, self.local.dtype, self.placements)

    def placement_text(self) -> str:
        return "{" + ", ".join(f"{n}: {p!r}" for n, p in zip(self.mesh.axis_names,
                                                            self.placements)) + "}"

    def __repr__(self) -> str:
        return (f"DArray(shape={self.shape}, dtype={self.dtype}, "
                f"placements={self.placement_text()}, local={tuple(self.local.shape)})")

    # ---- communication ------------------------------------------------------------------------

    @property
    def error_board(self):
        """Its mesh's (``comm.failfast.fails_together``): ``redistribute`` and ``full`` raise
        another rank's failure, at once on a failed mesh, as the groups' calls do."""
        return self.mesh.errors

    def world_ranks(self) -> tuple[int, ...]:
        """The ranks that run its collectives together: the mesh's."""
        return self.mesh.everyone.world_ranks()

    @fails_together
    def redistribute(self, placements) -> "DArray":
        """The same global array under other placements, with the fewest collectives (see
        ``redistribute.redistribution_steps``). The source is never modified. A redistribution seen
        before on this mesh runs its ``redistribute.Program``: the agreement check and the
        transfers, nothing worked out again."""
        mesh = self.mesh
        try:
            key = ("redistribute", self.shape, self.local.dtype, self.placements,
                   given_key(placements))
            program = mesh.programs.get(key)
        except TypeError:                             # unhashable placements: worked out anew
            key = program = None
        if program is None:
            dst, error = attempt(placements, placed, mesh, placements, self.shape)
            if mesh.checking:
                mesh.agree("redistribute",
                           self.agreement_fields() + [("target placements", dst)], error)
            elif error is not None:
                raise error
            program = Program(mesh, self.shape, self.local.dtype, self.placements, dst)
            if key is not None:
                mesh.remember(key, program)
        elif mesh.checking:
            program.check()
        with trusted():
            local = program.run(self.local)
        return DArray.unchecked(local, self.shape, mesh, program.dst)

    def full(self):
        """The whole global array on every rank (collective)."""
        return self.redistribute([Replicate()] * len(self.mesh.sizes)).local

    def like(self, local, placements=None) -> "DArray":
        """Another array of this shape on this mesh (``placements`` default: this one's)."""
        return DArray(local, self.shape, self.mesh,
                      self.placements if placements is None else placements)


def _infer_sizes(placements, coords, shapes, sizes) -> tuple[Placement, ...]:
    """Even shards whose pieces differ in length get their sizes (single-axis shards)."""
    out = list(placements)
    for axis, p in enumerate(placements):
        if not isinstance(p, Shard) or p.sizes is not None or len(shard_chain(placements,
                                                                               p.dim)) > 1:
            continue
        lengths = {}
        for c, s in zip(coords, shapes):
            lengths.setdefault(c[axis], s[p.dim])
        along = [lengths[k] for k in range(sizes[axis])]
        if len(set(along)) > 1 and p.unit == 1:
            out[axis] = Shard(p.dim, tuple(along))
    return tuple(out)


def _global_shape(placements, coords, shapes, sizes) -> tuple[int, ...]:
    """The global shape the pieces describe: along a sharded dimension, the sum of the
    pieces of one line of ranks through the sharding axes."""
    shape = list(shapes[0])
    by_coords = dict(zip(coords, shapes))
    for dim in range(len(shape)):
        chain = shard_chain(placements, dim)
        if not chain:
            continue
        if any(placements[a].unit > 1 for a in chain):
            raise PlacementError(f"from_local: dimension {dim} is sharded by whole units, whose "
                                 f"replicas the pieces cannot tell apart; pass shape=")
        fixed = coords[0]
        shape[dim] = sum(s[dim] for c, s in by_coords.items()
                         if all(c[i] == fixed[i] for i in range(len(c)) if i not in chain))
    return tuple(shape)
