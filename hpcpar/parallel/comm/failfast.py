"""An uncaught exception on one rank ends the whole job at once.

In an SPMD program the other ranks are usually waiting for the one that failed, in a
collective it will never join; when its Python exits with a traceback, MPI's finalize on
that rank does not end them, so they wait out their timeout (600 s by default) before they
fail too. ``python -m mpi4py`` solves this by aborting the job on an uncaught exception;
``abort_on_uncaught_exceptions()`` does the same for a program that builds a
``hpcpar.parallel.Mesh``: Python's hook prints the traceback as always, then
``MPI_Abort`` ends every rank (mpiexec reports it), within a second.

The hook is installed once per process and chains to the hook it replaces. Exceptions a
program catches are its own business; only those that would end the interpreter abort.
A rank that leaves with ``sys.exit(status)`` raises no uncaught exception (Python gives its
hooks no sight of it): call ``abort(status)`` there instead.
"""

from __future__ import annotations

import sys
import time

_installed = {"hook": None}

# MPI_Abort tears the job down at once: the launcher gets this long to forward what the rank
# just wrote (a traceback, an error line), or it can be lost (seen under mpiexec on a loaded
# machine: no line at all)
FORWARD_SECONDS = 0.2


def abort(status: int = 1) -> None:
    """End every rank of the job now with ``status`` (MPI_Abort on the world), once the
    launcher has had a moment to forward what this rank wrote."""
    from mpi4py import MPI
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):           # a closed pipe must not stop the abort
            pass
    if MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(FORWARD_SECONDS)
    MPI.COMM_WORLD.Abort(status)


def abort_on_uncaught_exceptions() -> None:
    """From now on an uncaught exception prints its traceback, then aborts the job."""
    if _installed["hook"] is not None:
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:
            previous(kind, value, traceback)
        finally:
            if not issubclass(kind, KeyboardInterrupt):  # mpiexec ends the job on Ctrl-C
                abort(1)

    _installed["hook"] = hook
    sys.excepthook = hook
