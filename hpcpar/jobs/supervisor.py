"""A rank's keeper: names the rank when its process dies without a word.

A rank killed by a signal (``kill -9``, the kernel's OOM killer, a segfault) can say nothing,
and the MPI launcher tears the job down at once, printing at best a PID. So under a launcher
``python -m hpcpar`` runs the job in a child process and waits for it, as torchrun's agent
does: when the child is ended by a signal, or exits without having gone through hpcpar's own
exit path (``os._exit``, a crash in C), this process prints one line naming the rank, its host
and PID, and exits with the child's status (128 + signal for a signal).

Signals the launcher or a scheduler sends (SIGTERM, SIGUSR1, SIGINT, ...) are passed on to the
child. The child dies with this process (``PR_SET_PDEATHSIG``), so a launcher that kills the
processes it started leaves no orphan; the signal it gets then is one of its own
(``KEEPER_GONE``), so that a keeper killed on its own (``kill -9`` of the wrong PID, the OOM
killer) is named by its rank, as a killed rank is named by its keeper. ``HPCPAR_SUPERVISE=0``
turns the keeper off.

Only the standard library here: it runs before NumPy or MPI are loaded, and stays small.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import stat
import subprocess
import sys

_CHILD = "HPCPAR_SUPERVISED_FD"      # set in the child: the pipe that says "exited through hpcpar"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
              signal.SIGQUIT, signal.SIGCONT)
_PR_SET_PDEATHSIG = 1
KEEPER_GONE = signal.SIGRTMIN + 3     # the child's death signal: no launcher sends it


def launcher_rank() -> int | None:
    """This task's rank, as the launcher (MPICH, Open MPI, PMIx, Slurm) says, if it does."""
    return _first_int("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_size() -> int | None:
    """How many tasks the launcher says it started, if it says."""
    return _first_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def _first_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def wanted() -> bool:
    """Whether this process should keep a child: several tasks under a launcher, on Linux,
    not already the child, not turned off."""
    return (sys.platform.startswith("linux") and _CHILD not in os.environ
            and _turned_on() and launcher_rank() is not None and (launcher_size() or 1) > 1)


def _turned_on() -> bool:
    """``HPCPAR_SUPERVISE`` (settings' table): 0 turns the keeper off. A bad value keeps it
    on here; the rank reports it as it checks every variable, before any work."""
    from ..parallel.errors import HpcparError
    from .settings import environment_value  # standard library only, as this module
    try:
        return environment_value("HPCPAR_SUPERVISE") != "0"
    except HpcparError:
        return True


def mark_known_exit() -> None:
    """Called by the child on hpcpar's own way out (a result, or an error it reported): the
    keeper then stays quiet about its status. Idempotent; a no-op when not supervised."""
    fd = os.environ.pop(_CHILD, None)
    if fd is not None:
        try:
            if stat.S_ISFIFO(os.fstat(int(fd)).st_mode):     # the keeper's pipe, nothing else
                os.write(int(fd), b"x")
        except (OSError, ValueError):
            pass


def supervise(command: list[str]) -> int:
    """Run ``command`` (``python -m hpcpar ...``) as a child, pass signals on, report an
    unexplained end; returns the status to exit with."""
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    env = dict(os.environ, **{_CHILD: str(write_end)})
    # close_fds=False: the launcher's own descriptors (MPICH's PMI_FD) must reach the child
    child = subprocess.Popen(command, env=env, close_fds=False, preexec_fn=_die_with(os.getpid()))
    os.close(write_end)
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(child, signum))
    status = child.wait()
    os.set_blocking(read_end, False)        # a grandchild may still hold the write end
    try:
        explained = os.read(read_end, 1) == b"x"
    except BlockingIOError:
        explained = False
    os.close(read_end)
    if status < 0:
        name = signal.Signals(-status).name
        _say(f"was killed by {name} (signal {-status})", child.pid)
        return 128 - status
    if status != 0 and not explained:
        _say(f"exited with status {status} without reporting an error (a crash, or os._exit)",
             child.pid)
    return status


def _forward(child: subprocess.Popen, signum: int) -> None:
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass


def _die_with(parent: int):
    """For the child, before exec: be sent SIGKILL when the keeper dies."""

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, KEEPER_GONE, 0, 0, 0)
        if os.getppid() != parent:              # the keeper died before prctl took effect
            os._exit(1)

    return setup


def watch_keeper() -> None:
    """In the child: when its keeper dies (``KEEPER_GONE``), say so, naming this rank and
    the keeper, and end at once (the launcher ends the other ranks)."""
    if _CHILD not in os.environ:
        return
    keeper = os.getppid()

    def gone(signum, frame):
        _say(f"lost its keeper (pid {keeper}), which was killed", os.getpid())
        os._exit(128 + signal.SIGKILL)

    signal.signal(KEEPER_GONE, gone)
    if os.getppid() != keeper:               # gone before the handler was in place
        gone(KEEPER_GONE, None)


def _say(what: str, pid: int) -> None:
    size = launcher_size()
    rank = f"rank {launcher_rank()}" + (f" of {size}" if size else "")
    print(f"hpcpar: error: {rank} (pid {pid} on {socket.gethostname()}) {what}; the launcher "
          "ends the other ranks", file=sys.stderr, flush=True)
