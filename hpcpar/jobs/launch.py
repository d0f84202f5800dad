"""How a job starts and ends on every rank.

Three rules keep an MPI job from hanging or flooding the terminal:

1. Validate before any real communication, on every rank, then *agree*: ``everyone(comm, fn)``
   runs ``fn`` on every rank and follows it with one tiny AllReduce. If any rank raised an
   ``HpcparError``, the lowest such rank prints its one-line message and every rank exits with
   status 2, with no traceback.
2. Anything else that escapes on any rank (a bug, a failed read mid-run) is printed by that
   rank with its mesh position and the phase it was in, and the whole world is aborted with
   ``MPI_Abort``, so no rank is left blocked in a collective. Ctrl-C outside a job's steps
   (or a second one) is one "interrupted" line from rank 0, and the same abort.
3. A process that finds itself alone where the launcher started several (an MPI library that
   does not match the launcher, e.g. ``srun --mpi=none``) stops instead of running N copies.

Output to a reader that went away (``hpcpar plan | head -1``) ends quietly, with the status of
a command killed by SIGPIPE (141), as other command-line tools do.

Jobs turn SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) into a request the ranks agree on at a step
boundary (a training step, a generation step: ``StopRequest``), then exit with
``EXIT_PREEMPTED`` after saving; a second Ctrl-C ends the job at once.
Every wait is bounded by the job's timeout; one that runs out (``CommTimeout``) ends the job
with ``EXIT_HUNG`` and a report of where the node's ranks are (``watchdog``).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from time import perf_counter
from typing import Callable, TypeVar

import numpy as np

from ..parallel import trace
from ..parallel.device import waits
from ..parallel.comm.failfast import abort
from ..parallel.errors import CommTimeout, HangElsewhere, HpcparError
from .supervisor import launcher_size, mark_known_exit

T = TypeVar("T")

EXIT_INVALID = 2   # bad input, reported once
EXIT_FAILED = 1    # anything else
EXIT_PREEMPTED = 3  # stopped on SIGTERM/SIGUSR1 after saving its state: run again to resume
EXIT_HUNG = 4       # a receive or collective outlasted --timeout: a rank stopped or hung
EXIT_REQUESTS_FAILED = 5   # done, and some Batch API requests got error records
EXIT_INTERRUPTED = 130   # a second Ctrl-C, or one before the job's steps: ended at once
EXIT_OUTPUT_CLOSED = 141  # stdout's reader went away (| head): 128 + SIGPIPE, as a shell shows

_state = {"phase": "start-up", "where": None, "board": None}


class JobFailed(SystemExit):
    """Raised on every rank once a failure has been agreed on and reported."""


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@contextmanager
def phase(name: str):
    """Name what this rank is doing, for the message if it fails."""
    previous = _state["phase"]
    _state["phase"] = name
    tracer = trace.current()
    begin = perf_counter() if tracer is not None else 0.0
    yield
    _state["phase"] = previous  # not on an exception: the report names where it happened
    if tracer is not None:
        tracer.add(name, "phase", begin, perf_counter())


def set_location(description: str) -> None:
    """Say where this rank sits in the mesh (e.g. 'rank 3 (dp 0, pp 1, tp 1)')."""
    _state["where"] = description


def set_timeout(seconds: float) -> None:
    """How long any wait on the other ranks or the GPU may take (the job's --timeout)."""
    waits.set_limit(seconds)


def set_board(board) -> None:
    """The job's ``watchdog.ActionBoard``, read for the hang report; every bounded wait
    listens for its alarm from another node."""
    _state["board"] = board
    waits.listen_for_alarm(board.alarm if board is not None else None)


def print_error(message: str) -> None:
    """One line on stderr, whatever the message holds."""
    print("hpcpar: error: " + " ".join(message.split()), file=sys.stderr, flush=True)


def everyone(comm, fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn`` on every rank of ``comm`` and stop all of them if it failed on any.

    Collective: every rank of ``comm`` must call it. On failure the lowest failing rank prints
    its message and every rank raises ``JobFailed``."""
    error: HpcparError | None = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except HpcparError as e:
        error = e
    rank, size = comm.Get_rank(), comm.Get_size()
    first_failed = np.array([rank if error is not None else size], dtype=np.int64)
    if size > 1:
        from mpi4py import MPI
        waits.wait_bounded(comm.Iallreduce(MPI.IN_PLACE, first_failed, op=MPI.MIN),
                     waits.limit(), f"agreeing while {_state['phase']}")
    if first_failed[0] < size:
        if rank == first_failed[0]:
            print_error(str(error))
        raise JobFailed(EXIT_INVALID)
    return result


def local_rank(comm) -> int:
    """This rank's index among the ranks of its node (collective over ``comm``)."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_rank()
    node.Free()
    return local


def check_launch(comm) -> None:
    started = launcher_size()
    if comm.Get_size() == 1 and started is not None and started > 1:
        raise HpcparError(
            f"the launcher started {started} tasks but MPI sees a world of 1: mpi4py's MPI "
            "library does not match the launcher. Use the mpiexec of the same MPI (with the "
            "mpich wheel: its own mpiexec, or 'srun --mpi=pmi2' under Slurm)")


def run_guarded(main: Callable[[], int | None]) -> int:
    """Run a job's main function under the rules above; returns the exit status."""
    try:
        status = main() or 0
        sys.stdout.flush()            # a reader gone shows here, not at the interpreter's exit
        return status
    except JobFailed as e:
        return int(e.code)
    except SystemExit as e:           # --help (0), or a library's own exit
        return e.code if isinstance(e.code, int) else EXIT_FAILED
    except CommTimeout as e:
        _report_hang(e)
    except KeyboardInterrupt:
        _interrupted()
    except HpcparError as e:
        # Failed on this rank alone, after validation: the others may be blocked in a
        # collective, so end them all.
        _abort(" ".join(f"{_who()}: {e}".split()), EXIT_INVALID, with_traceback=False)
    except BaseException as e:  # a bug, an I/O error mid-run
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            return _output_closed()
        _abort(f"{_who()} failed while {_state['phase']}: {type(e).__name__}: {e}",
               EXIT_FAILED, with_traceback=True)
    return EXIT_FAILED


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (another broken pipe is a failure)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _output_closed() -> int:
    """The reader of stdout went away (``hpcpar plan | head -1``): drop what is left to write
    and end without a word, as a command killed by SIGPIPE does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())      # the interpreter's last flush goes nowhere
    os.close(devnull)
    mark_known_exit()
    comm = world()
    if comm.Get_size() > 1:                    # the other ranks may wait for this one
        comm.Abort(EXIT_OUTPUT_CLOSED)
    return EXIT_OUTPUT_CLOSED


def _interrupted() -> None:
    """Ctrl-C that is not a stop request: every rank that got it ends the job; world rank 0
    alone says so (the launcher passes Ctrl-C to every rank)."""
    comm = world()
    mark_known_exit()
    if comm.Get_rank() == 0:
        print(f"hpcpar: interrupted (Ctrl-C) while {_state['phase']}: stopped at once; what "
              "was saved before is kept", file=sys.stderr, flush=True)
    if comm.Get_size() > 1:
        time.sleep(0.2 if comm.Get_rank() == 0 else 1.0)   # rank 0's abort comes first
        comm.Abort(EXIT_INTERRUPTED)
    raise SystemExit(EXIT_INTERRUPTED)


def _report_hang(e: CommTimeout) -> None:
    """One rank per node prints where its node's ranks are; on several nodes the first one
    alarms the others and every reporter lingers so that all the nodes' parts get out."""
    board = _state["board"]
    if board is None:
        _abort(f"{_who()}: {e}", EXIT_HUNG, with_traceback=False)
    linger = 1.0 if board.nodes > 1 else 0.0
    if not board.claim_report():
        time.sleep(2.0 + linger)         # another rank reports and ends the job; else we do
        world().Abort(EXIT_HUNG)
    if not isinstance(e, HangElsewhere):
        board.sound_alarm()
    what = "stopped waiting" if isinstance(e, HangElsewhere) else "gave up"
    where = "".join(f"\n  {line}" for line in board.report())
    _abort(f"{_who()} {what} while {_state['phase']}: {e}; a rank stopped, died or hangs. "
           f"{board.heading()}:{where}", EXIT_HUNG, with_traceback=False, linger=linger)


def location() -> str:
    """This rank's place, as ``set_location`` said it (or its world rank)."""
    return _who()


def _who() -> str:
    if _state["where"]:
        return _state["where"]
    try:
        comm = world()
        return f"rank {comm.Get_rank()} of {comm.Get_size()}"
    except Exception:
        return "rank ?"


def _abort(message: str, code: int, with_traceback: bool, linger: float = 0.0) -> None:
    if with_traceback:
        traceback.print_exc(file=sys.stderr)
    print(f"hpcpar: error: {message}", file=sys.stderr, flush=True)
    mark_known_exit()                 # said why: the rank's keeper need not
    if world().Get_size() > 1:
        time.sleep(linger)
        abort(code)                   # flushes, lets the launcher forward the lines, MPI_Abort
    sys.stdout.flush()
    raise SystemExit(code)


class StopRequest:
    """Context manager: SIGTERM / SIGUSR1 (a scheduler's time limit or preemption) and
    SIGINT (Ctrl-C) only set ``requested``; the job's ranks agree on it at their next step
    boundary, save and exit with ``EXIT_PREEMPTED``. A second Ctrl-C raises
    ``KeyboardInterrupt``: the job ends at once. Copies of one Ctrl-C (a rank's keeper
    passes on what its process group got too) arrive within ``AGAIN_AFTER`` seconds and
    count once. A signal to one rank is seen by every rank of its node at once (the
    watchdog's shared control row): ``requested`` is true there too, so a stage that polls
    it (the first pipeline stage) stops within a step whichever rank got the signal."""

    AGAIN_AFTER = 0.5
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self._requested = False
        self.signal_name: str | None = None        # the first signal that asked
        self.asked_by: int | None = None           # the world rank it reached, if another
        self._interrupted_at: float | None = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        if not self._requested and (board := _state["board"]) is not None:
            asked = board.stop_asked()
            if asked is not None:
                self._requested = True
                self.signal_name = signal.Signals(asked[0]).name
                self.asked_by = asked[1] if asked[1] != world().Get_rank() else None
        return self._requested

    @requested.setter
    def requested(self, value: bool) -> None:
        self._requested = value

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at is None:
                self._interrupted_at = now
            elif now - self._interrupted_at > self.AGAIN_AFTER:
                raise KeyboardInterrupt
        if not self._requested:
            self.signal_name = signal.Signals(signum).name
            if (board := _state["board"]) is not None:
                board.ask_stop(signum)
        self._requested = True

    def describe(self, when: str = "") -> str:
        """The stop as a user reads it: "stopped at step 5 on request (SIGTERM)" or
        "interrupted (Ctrl-C) at step 5" for ``when`` "at step 5"."""
        when = f" {when}" if when else ""
        to = f" to rank {self.asked_by}" if self.asked_by is not None else ""
        if self.signal_name == "SIGINT":
            return f"interrupted (Ctrl-C{to}){when}"
        return f"stopped{when} on request ({self.signal_name or 'SIGTERM/SIGUSR1'}{to})"

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            # a stop acted on: the rank is on its way out, and another SIGTERM (a launcher's
            # second, a keeper's copy) must not kill it while it saves and leaves
            stopping = self._requested and sig != signal.SIGINT
            signal.signal(sig, signal.SIG_IGN if stopping else handler)
