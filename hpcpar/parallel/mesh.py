"""A mesh of named axes over a communicator: coordinates, rank lookup, a group per axis.

The ranks of a communicator laid out row-major over axes of given sizes, the last axis
varying fastest. 8 ranks as ``Mesh(comm, {"dp": 2, "pp": 2, "tp": 2})``:

    rank   0  1  2  3  4  5  6  7
    dp     0  0  0  0  1  1  1  1
    pp     0  0  1  1  0  0  1  1
    tp     0  1  0  1  0  1  0  1

    group("tp")         [0,1] [2,3] [4,5] [6,7]      (ranks that differ only in tp)
    group("dp")         [0,4] [1,5] [2,6] [3,7]
    group(("pp","tp"))  [0,1,2,3] [4,5,6,7]          (a group over a set of axes)

The coordinate math is pure (``mesh_coords``, ``mesh_rank``, ``group_members``); ``Mesh``
builds the communicators once, from a Cartesian topology, and hands them out explicitly.
A group is a ``Communicator``: NumPy or CuPy arrays, MPI (CUDA-aware or staged) or NCCL,
every wait bounded by the mesh's timeout.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from .device.backend import NUMPY, ArrayBackend
from .comm import CommStats, Communicator, create_communicator
from .comm.agreement import ERROR, Check, active, agree_mpi
from .comm.failfast import ErrorBoard, abort_on_uncaught_exceptions
from .errors import HpcparError
from .device.waits import wait_bounded

Axes = str | Sequence[str]


class MeshError(HpcparError):
    """A mesh whose axes do not fit the communicator, or an axis it does not have."""


def resolve_shape(shape: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Axis sizes with at most one -1 inferred; the product must be the world size."""
    sizes = {str(k): int(v) for k, v in shape.items()}
    if not sizes:
        raise MeshError("a mesh needs at least one axis, e.g. {'x': world_size}")
    unknown = [k for k, v in sizes.items() if v == -1]
    if len(unknown) > 1 or any(v < 1 and v != -1 for v in sizes.values()):
        raise MeshError(f"mesh axes {sizes}: sizes must be >= 1, with at most one -1 to infer")
    known = math.prod(v for v in sizes.values() if v != -1)
    if unknown:
        if world_size % known:
            raise MeshError(f"mesh {_product_text(sizes)}: {world_size} ranks do not divide by "
                            f"{known}")
        sizes[unknown[0]] = world_size // known
    if math.prod(sizes.values()) != world_size:
        raise MeshError(f"mesh {_product_text(sizes)} = {math.prod(sizes.values())} != world "
                        f"size {world_size}")
    return sizes


def _product_text(sizes: Mapping[str, int]) -> str:
    return " * ".join(f"{k}({v})" for k, v in sizes.items())


def mesh_coords(rank: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` (last axis fastest)."""
    coords = []
    for n in reversed(sizes):
        rank, c = divmod(rank, n)
        coords.append(c)
    return tuple(reversed(coords))


def mesh_rank(coords: Sequence[int], sizes: Sequence[int]) -> int:
    """The rank at ``coords`` (inverse of ``mesh_coords``)."""
    rank = 0
    for c, n in zip(coords, sizes):
        if not 0 <= c < n:
            raise MeshError(f"coordinate {c} outside an axis of size {n}")
        rank = rank * n + c
    return rank


def group_members(rank: int, sizes: Sequence[int], axes: Sequence[int]) -> list[int]:
    """The ranks that share every coordinate of ``rank`` outside ``axes`` (group order:
    row-major over ``axes``)."""
    base = list(mesh_coords(rank, sizes))
    members = []
    for sub in _product(range(sizes[a]) for a in axes):
        for a, c in zip(axes, sub):
            base[a] = c
        members.append(mesh_rank(base, sizes))
    return members


def _product(ranges: Iterable[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [t + (i,) for t in out for i in r]
    return out


class Mesh:
    """This rank's place in a mesh of named axes, and a ``Communicator`` per axis.

    ``Mesh(comm, {"x": 2, "y": 2})`` over an mpi4py intracommunicator (one size may be -1:
    inferred). ``coords``, ``coord("x")``, ``rank_of(x=1, y=0)``, ``group("x")`` and
    ``group(("x", "y"))``. Every group's collectives move NumPy or CuPy arrays (``backend``)
    over ``comm_kind`` ("mpi", "nccl" or "auto"), and every wait gives up after ``timeout``
    seconds (0: never) with an error naming the operation, the group and the rank.
    Building a mesh, and the first ``group`` of a set of axes, are collective.

    ``check`` (default on): the ranks are checked to agree on what they pass to every
    collective operation (one all-reduce of two integers per call, ``comm.agreement``), so
    that ranks that disagree get one error each instead of wrong numbers; the mesh itself
    is checked to be built alike on every rank. ``abort_on_error`` (default on): an
    uncaught exception on any rank prints its traceback and ends the whole job at once
    (``comm.failfast``), instead of leaving the other ranks waiting for it until the
    timeout. ``share_errors`` (default on): an error leaving a collective, the MoE layer or
    a pipeline step on one rank, caught by the program or not, is told to every other rank,
    whose waits raise ``PeerFailed`` (``comm.failfast.ErrorBoard``).
    """

    _next_id = 0       # this process's meshes, numbered alike on every rank (``_agree_id``)

    def __init__(self, comm, shape: Mapping[str, int], *, backend: ArrayBackend = NUMPY,
                 comm_kind: str = "mpi", timeout: float = 600.0,
                 stats: CommStats | None = None, check: bool = True,
                 abort_on_error: bool = True, share_errors: bool = True):
        self.world = comm
        self.check = check
        if abort_on_error:
            abort_on_uncaught_exceptions()
        asked = [(str(k), v if isinstance(v, int) else repr(v)) for k, v in shape.items()] \
            if isinstance(shape, Mapping) else repr(shape)
        agree_mpi(comm, "Mesh", [("axes", asked), ("backend", backend.name),
                                 ("comm_kind", comm_kind), ("check", check),
                                 ("share_errors", share_errors)], timeout)
        self.id = self._agree_id(comm, timeout)
        self.shape = resolve_shape(shape, comm.Get_size())
        self.axis_names = tuple(self.shape)
        self.sizes = tuple(self.shape.values())
        self.rank = comm.Get_rank()
        self.coords = mesh_coords(self.rank, self.sizes)
        self.backend, self.comm_kind, self.timeout = backend, comm_kind, timeout
        self.stats = stats if stats is not None else CommStats()
        # reorder=False keeps cart ranks equal to the communicator's: row-major cart
        # coordinates are then ``mesh_coords``
        self.cart = comm.Create_cart(list(self.sizes), periods=[False] * len(self.sizes),
                                     reorder=False)
        self._groups: dict[tuple[int, ...], Communicator] = {}
        self._named: dict[str, Communicator] = {}
        # an error leaving one rank's entry point reaches every other (comm.failfast)
        self.errors = ErrorBoard(comm) if share_errors and comm.Get_size() > 1 else None
        for axis in range(len(self.sizes)):
            self._group((axis,))
        self._everyone = self._group(tuple(range(len(self.sizes))))
        self.fingerprint = f"mesh {self.id} {_product_text(self.shape)}"   # alike on all ranks
        self.programs: dict = {}      # work this rank did once for this mesh (``remember``)

    @classmethod
    def _agree_id(cls, comm, timeout: float) -> int:
        """A number every rank of ``comm`` gives this mesh, and no other mesh of this process
        shares: the largest next number of the ranks (so a rank's numbers only grow)."""
        number = np.array([cls._next_id], dtype=np.int64)
        wait_bounded(comm.Iallreduce(MPI.IN_PLACE, number, op=MPI.MAX), timeout, "Mesh")
        Mesh._next_id = int(number[0]) + 1
        return int(number[0])

    def agree(self, what: str, fields, error: Exception | None = None) -> None:
        """Every rank of the mesh passes equal ``fields`` (and this same mesh) to ``what``,
        or every rank raises ``Disagreement`` (one small all-reduce; none with
        ``check=False``). ``error``: this rank's own bad input, raised on every rank."""
        if self.checking:
            self.everyone.agree(what, [("mesh", self.fingerprint), *fields], error)
        elif error is not None:
            raise error

    def check_for(self, what: str, fields) -> Check | None:
        """``agree(what, fields)`` hashed once, for a check a loop repeats: call it (where
        ``checking``) to check. None where the mesh does not check."""
        if not self.check or self.everyone.size == 1:
            return None
        return Check(self.everyone.mpi_comm, what,
                     [("mesh", self.fingerprint), *fields, (ERROR, "")], self.everyone.timeout)

    def remember(self, key, program) -> None:
        """Keep ``program`` (a redistribution's ``Program``, a matmul's product and its check,
        ...) for ``key`` in ``programs``, for the next call that repeats it; a program whose
        shapes never repeat does not grow it without bound."""
        if len(self.programs) >= 4096:
            self.programs.clear()
        self.programs[key] = program

    @property
    def checking(self) -> bool:
        """Whether ``agree`` checks now (off inside a call already checked)."""
        return self.check and active(self.everyone)

    @property
    def everyone(self) -> Communicator:
        """The group of every rank of the mesh."""
        return self._everyone

    # ---- coordinates --------------------------------------------------------------------------

    def axis_index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise MeshError(f"the mesh has axes {list(self.axis_names)}, not {axis!r}") from None

    def size(self, axes: Axes) -> int:
        """Ranks along ``axes`` (one name or several)."""
        return math.prod(self.sizes[a] for a in self._indices(axes))

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.coords[self.axis_index(axis)]

    def is_first(self, axis: str) -> bool:
        """Whether this rank is the first along ``axis`` (the first pipeline stage on pp)."""
        return self.coord(axis) == 0

    def is_last(self, axis: str) -> bool:
        """Whether this rank is the last along ``axis`` (the last pipeline stage on pp)."""
        return self.coord(axis) == self.sizes[self.axis_index(axis)] - 1

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates; an axis left out is this rank's own."""
        full = list(self.coords)
        for name, c in coords.items():
            full[self.axis_index(name)] = c
        return mesh_rank(full, self.sizes)

    def coords_of(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world.Get_size():
            raise MeshError(f"rank {rank} outside a mesh of {self.world.Get_size()} ranks")
        return dict(zip(self.axis_names, mesh_coords(rank, self.sizes)))

    def members(self, axes: Axes) -> list[int]:
        """The ranks of this rank's group along ``axes``, in group-rank order."""
        return group_members(self.rank, self.sizes, self._indices(axes))

    # ---- groups -------------------------------------------------------------------------------

    def group(self, axes: Axes) -> Communicator:
        """The communicator of the ranks that differ from this one only along ``axes``;
        its group rank is the row-major coordinate over ``axes``."""
        try:
            return self._named[axes]                    # the hot path: an axis by name
        except (KeyError, TypeError):
            group = self._group(self._indices(axes))
            if isinstance(axes, str):
                self._named[axes] = group
            return group

    def _indices(self, axes: Axes) -> tuple[int, ...]:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        indices = tuple(sorted(self.axis_index(a) for a in names))
        if len(set(indices)) != len(indices):
            raise MeshError(f"axes {list(names)} name an axis twice")
        return indices

    def _group(self, indices: tuple[int, ...]) -> Communicator:
        group = self._groups.get(indices)
        if group is None:
            remain = [i in indices for i in range(len(self.sizes))]
            name = "+".join(self.axis_names[i] for i in indices)
            group = create_communicator(self.cart.Sub(remain), self.comm_kind, self.backend,
                                        self.stats, name, self.timeout, self.check)
            group.error_board = self.errors
            self._groups[indices] = group
        return group

    def describe(self) -> str:
        where = ", ".join(f"{n} {c}" for n, c in zip(self.axis_names, self.coords))
        return f"rank {self.rank} ({where})"

    def __repr__(self) -> str:
        return f"Mesh({self.shape})"

    def free(self) -> None:
        """Free the mesh's communicators (collective). A failed mesh's are kept: operations
        its ranks abandoned at the failure may still be posted on them, and a communicator
        made later could reuse a freed one's context and have its messages taken."""
        failed = self.errors is not None and self.errors.alarm() is not None
        if self.errors is not None:
            self.errors.close()
            self.errors = None
        if not failed:
            for group in self._groups.values():
                group.mpi_comm.Free()
            self.cart.Free()
        self._groups.clear()
        self._named.clear()
        self.programs.clear()
