"""A user's program whose rank fails ends the whole job at once, not after the mesh's
timeout: an uncaught exception on one rank prints its traceback and aborts every rank
(``hpcpar.parallel.comm.failfast``), and ``hp.comm.failfast.abort(status)`` does it on purpose. The
other rank is waiting in a collective the failed one never joins; each job's timeout below (120 s)
is far below the mesh's (600 s), so a job that waits for the mesh's timeout fails the test."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import MPIEXEC

# processes of their own: the whole suite's tier, not tests/run --quick
pytestmark = pytest.mark.slow

PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import hpcpar.parallel as hp

    mesh = hp.Mesh(MPI.COMM_WORLD, {"x": -1}, timeout=600)
    if mesh.rank == 1:
        if sys.argv[1] == "raise":
            raise ValueError("a bug on rank 1")
        hp.comm.failfast.abort(3)
    mesh.group("x").all_reduce(np.ones(3))      # rank 1 never joins
    print("rank 0 finished the all-reduce", flush=True)
""")


def _run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HPCPAR_BACKEND", None)
    return subprocess.run([MPIEXEC, "-n", "2", sys.executable,
                           str(program), mode], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("mode", ["raise", "abort"])
def test_a_failing_rank_ends_every_rank_at_once(tmp_path, mode):
    done = _run(tmp_path, mode)             # (rank 0 may see its all-reduce end as MPI
    assert done.returncode == (1 if mode == "raise" else 3)     # tears the job down)
    if mode == "raise":
        assert "ValueError: a bug on rank 1" in done.stderr      # its traceback, as always
