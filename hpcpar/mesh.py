"""The rank mesh: world rank <-> (dp, pp, cp, tp) coordinates and the sub-communicators.

    rank = ((dp_rank * pp_size + pp_rank) * cp_size + cp_rank) * tp_size + tp_rank

tp varies fastest, then cp: a context-parallel group passes K/V blocks around its ring in
every layer, the heaviest traffic after tp's, so it sits on neighbouring ranks (one node when
tp * cp fits one), as in Megatron's tp-cp-dp-pp order. cp is 1 unless asked for; with cp 1
the mesh is the 3-D one below.

Worked example, 8 ranks as dp=2 × pp=2 × tp=2:

    rank   0  1  2  3  4  5  6  7
    dp     0  0  0  0  1  1  1  1
    pp     0  0  1  1  0  0  1  1
    tp     0  1  0  1  0  1  0  1

    tp groups  [0,1] [2,3] [4,5] [6,7]     AllReduce inside each layer (same node)
    pp groups  [0,2] [1,3] [4,6] [5,7]     activations flow 0 -> 2, 1 -> 3, ...
    dp groups  [0,4] [1,5] [2,6] [3,7]     gradient AllReduce between replicas

and 16 ranks as dp=2 × pp=2 × tp=4:

    tp groups  [0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]
    pp groups  [0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]
    dp groups  [0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]

With tp fastest, a tp group is a block of consecutive ranks, so launchers that fill nodes in
rank order keep each tp group on one node. This is the library's mesh of named axes
(``hpcpar.parallel.Mesh``) with the axes dp, pp, tp: the coordinate math is the core's pure
functions, and the communicators are the core mesh's groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ParallelConfig
from .parallel.mesh import Mesh as CoreMesh, group_members, mesh_coords, mesh_rank

if TYPE_CHECKING:  # mpi4py is only needed to build a Mesh, not for the math
    from mpi4py import MPI

AXES = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class MeshCoords:
    dp_rank: int
    pp_rank: int
    tp_rank: int
    cp_rank: int = 0


def _sizes(layout: ParallelConfig) -> tuple[int, int, int, int]:
    return layout.dp, layout.pp, layout.cp, layout.tp


def coords_of(rank: int, layout: ParallelConfig) -> MeshCoords:
    """The (dp, pp, cp, tp) coordinates of world rank ``rank``."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside a world of {layout.world_size}")
    dp, pp, cp, tp = mesh_coords(rank, _sizes(layout))
    return MeshCoords(dp, pp, tp, cp)


def rank_of(coords: MeshCoords, layout: ParallelConfig) -> int:
    """The world rank at ``coords`` (inverse of ``coords_of``)."""
    return mesh_rank((coords.dp_rank, coords.pp_rank, coords.cp_rank, coords.tp_rank),
                     _sizes(layout))


def describe_rank(rank: int, layout: ParallelConfig) -> str:
    """'rank 5 (dp 1, pp 0, tp 1)', with cp where the layout has it."""
    c = coords_of(rank, layout)
    cp = f", cp {c.cp_rank}" if layout.cp > 1 else ""
    return f"rank {rank} (dp {c.dp_rank}, pp {c.pp_rank}{cp}, tp {c.tp_rank})"


def by_stage(per_rank: list, layout: ParallelConfig) -> list[list]:
    """Items given in world-rank order, grouped by the pipeline stage of their rank."""
    groups: list[list] = [[] for _ in range(layout.pp)]
    for rank, item in enumerate(per_rank):
        groups[coords_of(rank, layout).pp_rank].append(item)
    return groups


def group_ranks(layout: ParallelConfig, axis: str) -> list[list[int]]:
    """Every group along ``axis`` ('dp', 'pp', 'cp' or 'tp'), each in group-rank order."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.world_size):
        members = group_members(rank, _sizes(layout), (AXES.index(axis),))
        groups.setdefault(tuple(members), members)
    return list(groups.values())


class Mesh:
    """This rank's place in the mesh and its tp / pp / dp / cp communicators (mpi4py
    Intracomms), and ``grad_comm``: the ranks that hold the same weights (dp and cp), over
    which gradients are summed.

    Built once per job from the world communicator; pass it (or the communicators it holds)
    explicitly to whatever needs them. Group ranks equal the coordinate on that axis:
    ``tp_comm.Get_rank() == coords.tp_rank``, and so on.
    """

    def __init__(self, world: "MPI.Intracomm", layout: ParallelConfig):
        if layout.world_size != world.Get_size():
            layout.check(world_size=world.Get_size())
        self.world = world
        self.layout = layout
        self.rank = world.Get_rank()
        self.coords = coords_of(self.rank, layout)
        # the jobs report their own errors (launch.py) and their groups follow one plan
        self.core = CoreMesh(world, dict(zip(AXES, _sizes(layout))), abort_on_error=False)
        self.dp_comm, self.pp_comm, self.cp_comm, self.tp_comm = (
            self.core.group(a).mpi_comm for a in AXES)
        self.grad_comm = (self.core.group(("dp", "cp")).mpi_comm if layout.cp > 1
                          else self.dp_comm)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def pp_rank(self) -> int:
        return self.coords.pp_rank

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def cp_rank(self) -> int:
        return self.coords.cp_rank

    @property
    def grad_rank(self) -> int:
        """This rank's place among the ranks that hold its weights (dp and cp)."""
        return self.dp_rank * self.layout.cp + self.cp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def prev_stage(self) -> int | None:
        """The previous stage's rank in ``pp_comm``, or None on the first stage."""
        return None if self.is_first_stage else self.pp_rank - 1

    @property
    def next_stage(self) -> int | None:
        """The next stage's rank in ``pp_comm``, or None on the last stage."""
        return None if self.is_last_stage else self.pp_rank + 1

    def describe(self) -> str:
        return describe_rank(self.rank, self.layout)

    def free(self) -> None:
        self.core.free()
