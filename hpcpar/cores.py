"""How many ranks share this node's cores, as the launcher says (standard library only: it is
read before NumPy loads its BLAS)."""

from __future__ import annotations

import os

# the launchers' count of the ranks on this node: MPICH's hydra, Open MPI, Slurm
_RANKS_ON_NODE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def ranks_on_node() -> int | None:
    """The number of ranks the launcher started on this node, if it says."""
    for var in _RANKS_ON_NODE:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def one_blas_thread() -> bool:
    """Whether NumPy's BLAS runs one thread, as OpenBLAS reads its settings (as hpcpar sets
    them per rank, or the user): unset, it runs one per core."""
    for var in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value:
            return value == "1"
    return cores() == 1


def oversubscribed() -> bool:
    """More ranks on this node than cores (8 ranks on a 2-core laptop): a rank that spins
    while it waits takes a core from a rank that works."""
    ranks = ranks_on_node()
    return ranks is not None and ranks > cores()
