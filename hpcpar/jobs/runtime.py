"""What every job sets up on every rank before its first step, written once for generation,
scoring and training: its checkpoint (a file, or a preset's random model in the cache folder),
the mesh, the device, the communicators and the watchdog's board.

The tensor-parallel and data-parallel groups use the job's communicator choice (MPI or
NCCL); pipeline and context-parallel (ring) messages stay on MPI (NCCL point-to-point on one
stream would queue compute behind receives posted ahead, and a ring's sends and receives
would wait on each other); ``world`` carries host metadata over MPI. Gradients are summed
over dp and cp together: the ranks of a cp group hold the same weights and saw different
tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import init_checkpoint
from ..parallel.device.backend import NUMPY, ArrayBackend, select_backend
from ..parallel.comm import CommStats, Communicator, create_communicator
from ..parallel.mesh import Mesh
from ..parallel.tensor.splits import expert_block
from .job import PRESET_PREFIX, Job
from .launch import everyone, local_rank, phase, set_board, set_location
from .layout import ParallelConfig, describe_rank, grad_axes, job_mesh
from .settings import environment_value
from .watchdog import ActionBoard


def cache_dir() -> Path:
    root = environment_value("HPCPAR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcpar")
    return Path(root)


def resolve_checkpoint(comm, spec: str) -> Path:
    """The checkpoint file for ``spec``: a path, or ``preset:NAME`` for a random model of that
    preset kept in the cache folder (rank 0 creates it on first use). Collective."""
    if not spec.startswith(PRESET_PREFIX):
        return Path(spec)
    name = spec[len(PRESET_PREFIX):]
    path = cache_dir() / f"{name}-seed0.h5"

    def create():
        if comm.Get_rank() == 0 and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            init_checkpoint(path, name, seed=0)

    with phase(f"creating the {name} checkpoint in {path.parent}"):
        everyone(comm, create)
    return path


@dataclass
class Runtime:
    mesh: Mesh
    backend: ArrayBackend
    stats: CommStats
    tp: Communicator
    pp: Communicator
    dp: Communicator | None     # dp x cp: only where the job reduces gradients (training)
    cp: Communicator | None     # the context-parallel ring, where cp > 1
    world: Communicator         # every rank, host arrays (MPI)
    board: ActionBoard
    ep: Communicator | None = None     # the ep replicas whose experts a MoE layer splits
    edp: Communicator | None = None    # the ranks holding this rank's experts (training)

    def close(self) -> None:
        """Free the job's communicators and its board (collective; at the job's end). A
        process that runs many jobs (a library user, a test session) would otherwise run out
        of MPI's few thousand communicators."""
        for group in (self.ep, self.edp):
            if group is not None:
                group.mpi_comm.Free()
        close_runtime(self.mesh, self.board)


def close_runtime(mesh: Mesh, board: ActionBoard) -> None:
    set_board(None)
    board.free()
    mesh.free()


def open_runtime(comm, job: Job, layout: ParallelConfig, dtype: np.dtype,
                 data_parallel: bool = False) -> Runtime:
    """Collective over ``comm``: this rank's place in the mesh, device and communicators."""
    mesh = job_mesh(comm, layout)
    set_location(describe_rank(mesh.rank, layout))
    backend = everyone(comm, select_backend, job.parallel.backend, local_rank(comm), dtype)
    stats, timeout, kind = CommStats(), job.parallel.timeout, job.parallel.comm

    def over(axes, comm_kind: str, name: str) -> Communicator:
        return create_communicator(mesh.group(axes).mpi_comm, comm_kind, backend, stats, name,
                                   timeout, check=False)

    tp, pp = over("tp", kind, "tp"), over("pp", "mpi", "pp")
    dp = over(grad_axes(layout), kind, "dp") if data_parallel else None
    cp = over("cp", "mpi", "cp") if layout.cp > 1 else None
    world = create_communicator(comm, "mpi", NUMPY, None, "world", timeout, check=False)
    board = ActionBoard(comm, layout)
    set_board(board)
    runtime = Runtime(mesh, backend, stats, tp, pp, dp, cp, world, board)
    if layout.ep > 1:
        # dp replica d is rank d % ep of ep group d // ep, and holds the experts of the
        # replicas d' = d (mod ep) (with each cp rank: the ranks of a cp group hold the same)
        d, ep = mesh.coord("dp"), layout.ep

        def split(group: str, color: int, name: str) -> Communicator:
            sub = mesh.group(group).mpi_comm.Split(color, mesh.group(group).rank)
            return create_communicator(sub, "mpi", backend, stats, name, timeout, check=False)

        runtime.ep = split("dp", d // ep, "ep")
        if data_parallel:
            runtime.edp = split(grad_axes(layout), d % ep, "edp")
    return runtime


def experts_held(cfg, ep: Communicator | None) -> range | None:
    """The experts of each MoE layer this rank holds: its ep rank's block (None: all)."""
    if ep is None or ep.size == 1 or not cfg.moe_layers:
        return None
    return expert_block(cfg.num_experts, ep.size, ep.rank)
