"""``python -m hpcpar`` (under ``mpiexec -n N`` or alone)."""

import os
import sys

from .cores import cores, ranks_on_node


def _share_cores_between_ranks() -> None:
    """Give each rank of a node its share of the cores for BLAS, unless the user chose.

    Must run before NumPy loads its BLAS: N ranks on a node each starting a pool of every
    core would oversubscribe the cores N times (and ranks waiting in MPI spin on them)."""
    ranks = ranks_on_node()
    if ranks is not None and ranks > 1:
        share = str(max(1, cores() // ranks))
        for threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(threads, share)


_share_cores_between_ranks()

from .jobs import supervisor  # noqa: E402  (standard library only)

if supervisor.wanted():
    raise SystemExit(supervisor.supervise([sys.executable, "-m", "hpcpar", *sys.argv[1:]]))
supervisor.watch_keeper()

from .jobs.cli import main  # noqa: E402

try:
    status = main()
finally:
    supervisor.mark_known_exit()
raise SystemExit(status)
