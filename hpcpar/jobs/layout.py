"""The jobs' layout: the dp × pp × cp × tp layout of a job (``ParallelConfig``), world rank <->
(dp, pp, cp, tp) coordinates, and the job's mesh.

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
rank order keep each tp group on one node. A job's mesh is the library's mesh of named axes
(``hpcpar.parallel.Mesh``, ``job_mesh``) with the axes dp, pp, cp, tp: the coordinate math
is the core's pure functions, and the communicators are its groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..models.config import ConfigError, ModelConfig, ep_problems, tp_problems
from ..parallel.mesh import Mesh, group_members, mesh_coords, mesh_rank
from . import settings

if TYPE_CHECKING:  # mpi4py is only needed to build a Mesh, not for the math
    from mpi4py import MPI

AXES = ("dp", "pp", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class ParallelConfig:
    """The dp × pp × cp × tp layout and how the pipeline runs.

    ``cp`` splits every sequence over its ranks (context parallelism: ring attention, see
    ``parallel.context_parallel.ring_attention``); it is 1 unless asked for, never inferred.

    ``stage_layers`` optionally fixes how many decoder layers each pipeline stage holds;
    without it the layers are split evenly with the remainder on the first stages.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    micro_batches: int = 1
    cp: int = 1
    schedule: str = "gpipe"
    stage_layers: tuple[int, ...] | None = None
    ep: int = 1          # expert parallelism: each MoE layer's experts split over ep of the
                         # dp replicas (carved out of dp, as Megatron-Core does)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @classmethod
    def infer(cls, world_size: int, dp: int | None = None, pp: int | None = None,
              tp: int | None = None, cp: int | None = None, **rest) -> "ParallelConfig":
        """Fill in absent factors from the world size.

        An absent tp or pp is 1, unless it is the only factor missing, and an absent dp takes
        whatever the world size leaves (Megatron's convention); cp is 1 unless given. A world
        size the given factors
        do not divide is left for ``check`` to report with the numbers.
        """
        given = {"dp": dp, "pp": pp, "tp": tp}
        missing = [k for k, v in given.items() if v is None]
        if len(missing) == 1 or "dp" in missing:
            fill = "dp" if "dp" in missing else missing[0]
        else:
            fill = "tp" if "tp" in missing else None
        for k in missing:
            given[k] = 1
        cp = 1 if cp is None else cp
        if fill is not None:
            others = [v for k, v in given.items() if k != fill]
            product = others[0] * others[1] * cp
            if product > 0 and world_size % product == 0:
                given[fill] = world_size // product
        return cls(dp=given["dp"], pp=given["pp"], tp=given["tp"], cp=cp, **rest)

    def problems(self, model: ModelConfig | None = None,
                 world_size: int | None = None) -> list[str]:
        """Every reason this layout cannot run ``model`` on ``world_size`` ranks."""
        sizes = {name: getattr(self, name) for name in ("dp", "pp", "cp", "tp", "ep",
                                                          "micro_batches")}
        out = [f"{name} must be an integer, got {value!r}" for name, value in sizes.items()
               if not isinstance(value, int) or isinstance(value, bool)]
        out += settings.problems("parallel", sizes)
        if out:
            return out
        if world_size is not None and world_size % self.cp:
            out.append(f"cp {self.cp} does not divide the world of {world_size} ranks; choose "
                       f"a cp among {', '.join(map(str, _divisors(world_size)))}")
        elif world_size is not None and self.world_size != world_size:
            out.append(f"{self.product_text()} = {self.world_size} != world size "
                       f"{world_size}; change the layout or the number of ranks")
        if self.dp % self.ep:
            out.append(f"ep {self.ep} does not divide dp {self.dp}: the ep groups are carved out "
                       f"of the data-parallel replicas; choose an ep among "
                       f"{', '.join(map(str, _divisors(self.dp)))}")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if model is None:
            return out
        tp_issues = tp_problems(model, self.tp)
        if tp_issues:
            valid = model.valid_tp_sizes(limit=max(8, self.tp))
            out += tp_issues
            out.append(f"tp sizes this model supports: {', '.join(map(str, valid))}")
        out += ep_problems(model, self.ep)
        layers = model.num_hidden_layers
        if self.pp > layers:
            out.append(f"pp {self.pp} stages > num_hidden_layers {layers}: every stage needs at "
                       f"least one layer")
        if self.stage_layers is not None:
            counts = list(self.stage_layers)
            if len(counts) != self.pp:
                out.append(f"stage_layers has {len(counts)} entries for pp {self.pp} stages")
            if sum(counts) != layers:
                out.append(f"stage_layers {counts} sum to {sum(counts)}, "
                           f"not num_hidden_layers {layers}")
            if any(c < 1 for c in counts):
                out.append(f"stage_layers {counts}: every stage needs at least one layer")
        return out

    def product_text(self) -> str:
        """'dp(2) * pp(2) * tp(2)', with cp where it is > 1."""
        cp = f" * cp({self.cp})" if self.cp > 1 else ""
        return f"dp({self.dp}) * pp({self.pp}){cp} * tp({self.tp})"

    def describe(self) -> str:
        """'dp 2 x pp 2 x tp 2', with cp where it is > 1 (reports, checkpoints)."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return f"dp {self.dp}{ep} x pp {self.pp}{cp} x tp {self.tp}"

    def check(self, model: ModelConfig | None = None, world_size: int | None = None) -> None:
        problems = self.problems(model, world_size)
        if problems:
            raise ConfigError("invalid parallel layout", problems)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    """'rank 5 (dp 1, pp 0, tp 1)', with ep and cp where the layout has them (a replica's
    place in its ep group: replica d is rank d mod ep of group d div ep)."""
    c = coords_of(rank, layout)
    ep = f", ep {c.dp_rank % layout.ep}" if layout.ep > 1 else ""
    cp = f", cp {c.cp_rank}" if layout.cp > 1 else ""
    return f"rank {rank} (dp {c.dp_rank}{ep}, pp {c.pp_rank}{cp}, tp {c.tp_rank})"


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


def job_mesh(world: "MPI.Intracomm", layout: ParallelConfig) -> Mesh:
    """The core's mesh over ``world`` with the axes dp, pp, cp, tp of ``layout`` (a group's
    rank equals the coordinate on its axis). The jobs report their own errors (``launch``), so
    it does not abort the world on one."""
    if layout.world_size != world.Get_size():
        layout.check(world_size=world.Get_size())
    # the jobs end on any rank's error themselves (launch), and the watchdog reports a hang
    return Mesh(world, dict(zip(AXES, _sizes(layout))), abort_on_error=False,
                share_errors=False)


def grad_axes(layout: ParallelConfig) -> tuple[str, ...]:
    """The axes of the ranks that hold the same weights (dp, and cp where it is > 1), over
    which gradients are summed."""
    return ("dp", "cp") if layout.cp > 1 else ("dp",)


def grad_rank(mesh: Mesh) -> int:
    """This rank's place among the ranks that hold its weights (dp and cp)."""
    return mesh.coord("dp") * mesh.size("cp") + mesh.coord("cp")
