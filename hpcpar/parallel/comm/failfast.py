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

An error a program catches does not end the job, but it still leaves the other ranks
waiting for this one: every ``Mesh`` has an ``ErrorBoard``, on which the library's entry
points (``fails_together``: the collectives, the MoE layer, the pipeline) tell every other
rank of the mesh about an error leaving them, whichever group it was in. Each of those
ranks' waits on the mesh raise ``PeerFailed`` naming the rank and its message, within a
poll, and so does every later call on the mesh. An error that every rank of the call
raised together (a ``Disagreement``, or bad input a check agreed over the call's group:
``agreement.agreed``) leaves nobody of the call waiting, and nobody is told: a layer's
``from_full`` over a tp group whose split does not fit raises on every rank of the group,
and the mesh goes on. An entry point over several groups (an MoE layer's forward, a
pipeline step) tells of an error agreed over only one of them: its other ranks may be
waiting. A failure on one mesh is no failure of another.
"""

from __future__ import annotations

import atexit
import functools
import sys
import time

import numpy as np

from ..device import waits
from ..errors import HangElsewhere, HpcparError, PeerFailed, Stopped
from .agreement import world_ranks_of

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


MESSAGE_BYTES = 512          # a failure's word: its text, then the failed rank (world)


def failure_message(error: BaseException, world_rank: int) -> np.ndarray:
    """``error``'s word to the other ranks, ``MESSAGE_BYTES`` long (the text cut to fit)."""
    msg = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
    raw = describe(error).encode()[:MESSAGE_BYTES - 4]
    msg[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    msg[-4:] = np.array([world_rank], dtype=np.int32).view(np.uint8)
    return msg


def failure_of(msg: np.ndarray) -> PeerFailed:
    """The ``PeerFailed`` a received ``failure_message`` stands for."""
    rank = int(msg[-4:].view(np.int32)[0])
    return PeerFailed(rank, msg[:-4].tobytes().rstrip(b"\0").decode(errors="replace"))


class ErrorBoard:
    """A side channel over a mesh's ranks (its own duplicate of the communicator): a rank
    that fails tells every other why (``announce``), and their waits inside the mesh's
    entry points raise it (``alarm``, polled by ``waits`` while such a call runs). A
    failure, once known, stays: the mesh's ranks are no longer in step."""

    TAG = 31_338

    def __init__(self, comm):
        """Collective over ``comm`` (an mpi4py intracommunicator)."""
        from mpi4py import MPI
        self.comm = comm.Dup()
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.world_ranks = frozenset(world_ranks_of(self.comm))
        self.buf = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
        self.request = self.comm.Irecv(self.buf, source=MPI.ANY_SOURCE, tag=self.TAG)
        self.failure: PeerFailed | None = None       # the mesh runs nothing after it
        self._sent: list = []
        _boards.append(self)

    def alarm(self) -> PeerFailed | None:
        """The mesh's failure: another rank's, once its word has arrived, or this one's."""
        # (MPICH: a word that arrived while this rank was out of MPI completes on the second
        # test, the first draining the transport)
        if (self.failure is None and self.request is not None
                and (self.request.Test() or self.request.Test())):
            self.request = None
            self.failure = failure_of(self.buf)
        return self.failure

    def announce(self, error: BaseException) -> None:
        """Tell every other rank that this one failed with ``error`` (not when the mesh has
        failed already, or when every rank of the mesh raised ``error`` too)."""
        if self.alarm() is not None or raised_together(error, self.world_ranks):
            return
        msg = failure_message(error, self.world_rank)
        # kept alive until delivered (a message this small leaves at once: MPI's eager sends)
        self._sent = [msg] + [self.comm.Isend(msg, dest=r, tag=self.TAG)
                              for r in range(self.size) if r != self.rank]
        self.failure = failure_of(msg)

    def close(self) -> None:
        """Stop listening and free the channel (each rank of the mesh frees its own)."""
        if self in _boards:
            _boards.remove(self)
        if self.request is not None and not self.request.Test():
            self.request.Cancel()
            self.request.Wait()
        self.request = None
        for send in self._sent[1:]:
            send.Test()
        self.comm.Free()


_boards: list[ErrorBoard] = []


def describe(error: BaseException) -> str:
    """An error as the other ranks are told it: hpcpar's by its text, others by kind too."""
    return str(error) if isinstance(error, HpcparError) else f"{type(error).__name__}: {error}"


def raised_together(error: BaseException, ranks) -> bool:
    """Whether every one of the world ``ranks`` raised ``error`` together (an agreed error,
    ``agreement.agreed``): none of them is left waiting for another."""
    return frozenset(ranks) <= getattr(error, "agreed_ranks", frozenset())


def tell_peers(error: BaseException) -> None:
    """Tell the other ranks of this process's meshes that this one failed with ``error``
    (a program's own error, caught: their next call on the mesh raises it)."""
    for board in list(_boards):
        board.announce(error)


def fails_together(method):
    """An entry point whose errors reach the other ranks. A method of an object on a mesh
    (a group, a layer, a pipeline: its ``error_board``, None off a mesh) tells that mesh,
    unless every rank of the call raised the error together (the object's
    ``world_ranks()``: the ranks that run its calls, all in ``agreed_ranks``), and while it
    runs its waits raise a failure another rank of the mesh tells; a call on a failed mesh
    raises the failure at once (the other ranks have left, and a collective matched with
    another step's would move wrong numbers). Any other function (a program's own) tells
    every mesh of the process (``tell_peers``) what not every rank of it raised."""
    @functools.wraps(method)
    def entry_point(*args, **kwargs):
        if not (args and hasattr(args[0], "error_board")):
            try:
                return method(*args, **kwargs)
            except (Stopped, PeerFailed, HangElsewhere):
                raise
            except Exception as e:
                tell_peers(e)
                raise
        board = args[0].error_board
        if board is None:
            return method(*args, **kwargs)
        if (failure := board.alarm()) is not None:
            raise failure
        waits.add_alarm(board.alarm)
        try:
            return method(*args, **kwargs)
        except (Stopped, PeerFailed, HangElsewhere):
            raise                    # a stop request, another rank's failure: not this one's
        except Exception as e:
            ranks = getattr(args[0], "world_ranks", None)
            if not (hasattr(e, "agreed_ranks") and ranks is not None
                    and raised_together(e, ranks())):
                board.announce(e)
            raise
        finally:
            waits.remove_alarm(board.alarm)
    return entry_point


@atexit.register             # before mpi4py's own (registered earlier): MPI is still up
def _close_boards() -> None:
    for board in list(_boards):
        try:
            board.close()
        except Exception:      # noqa: BLE001 (an MPI already finalized: nothing to free)
            pass
