"""Bounded waiting: the one way a rank waits on other ranks or on its GPU.

Every wait that another rank can hold up (an MPI request; the GPU stream, when NCCL
collectives are queued on it) polls with a deadline instead of blocking, so a peer that
stopped or died ends the job through the watchdog (``CommTimeout``) rather than hanging it.
A wait also gives up at once when the watchdog's alarm says another node found the job hung.
"""

from __future__ import annotations

import os
from time import monotonic, sleep
from typing import Callable

from ...cores import oversubscribed
from ..errors import CommTimeout, HangElsewhere

_state: dict = {"limit": 600.0, "alarm": None}     # the CLI's default --timeout
_alarms: list[Callable[[], Exception | None]] = []  # error boards of the meshes now called

# Ranks that share cores (more on the node than it has) sleep between polls once a wait has
# lasted SPIN_SECONDS: a yield leaves a spinning rank runnable, and the scheduler shares the
# cores fairly between it and the rank it waits for (8 ranks on 2 cores: a generation 17%
# faster, tests/test_generate_mpi.py). On a core of its own a rank only spins and yields.
SPIN_SECONDS, NAP_SECONDS = 1e-3, 2e-4
_NAP = oversubscribed()


def set_limit(seconds: float) -> None:
    """The job's ``--timeout``: how long a wait on the device may take (0: forever)."""
    _state["limit"] = seconds


def limit() -> float:
    return _state["limit"]


def listen_for_alarm(alarm: Callable[[], int | Exception | None] | None) -> None:
    """Make every bounded wait also give up when ``alarm()`` names a rank (the watchdog's
    alarm from another node) or returns an exception (raised as it is); None: stop
    listening."""
    _state["alarm"] = alarm


def current_alarm() -> Callable[[], int | Exception | None] | None:
    return _state["alarm"]


def add_alarm(alarm: Callable[[], Exception | None]) -> None:
    """Make every bounded wait also raise what ``alarm()`` returns, when not None (the
    ``failfast.ErrorBoard`` of a mesh whose entry point runs: another rank failed), besides
    the watchdog's alarm, until ``remove_alarm``."""
    _alarms.append(alarm)


def remove_alarm(alarm: Callable[[], Exception | None]) -> None:
    if alarm in _alarms:
        _alarms.remove(alarm)


def wait_bounded(req, timeout: float, what: str) -> None:
    """Wait for an MPI request (``Test``/``Wait``); with a timeout, poll it and give up with
    ``CommTimeout``: a rank that stopped or died must not leave this one waiting forever."""
    if timeout <= 0:
        req.Wait()
        return
    poll_until(req.Test, timeout, what)


def poll_until(done: Callable[[], bool], timeout: float, what: str) -> None:
    """Call ``done()`` until it is true; after ``timeout`` seconds, or when another node
    raised the alarm, give up with ``CommTimeout``."""
    start = monotonic()
    deadline = start + timeout
    polls = 0
    while not done():
        polls += 1
        if polls % 16 == 0:
            # oversubscribed ranks share the cores: let the one this wait needs run (every
            # 16 polls: a 4-byte all-reduce of 4 ranks on 2 cores took 93 us yielding every
            # 256, 20 us every 16; on a core of its own a yield returns at once)
            if _NAP and monotonic() - start > SPIN_SECONDS:
                sleep(NAP_SECONDS)
            else:
                os.sched_yield()
        if polls % 256 == 0:
            if monotonic() > deadline:
                raise CommTimeout(f"{what} waited {timeout:g} s")
            alarm = _state["alarm"]
            if alarm is not None and (rank := alarm()) is not None:
                if isinstance(rank, Exception):       # a peer's own report of its failure
                    raise rank
                raise HangElsewhere(rank)
            for board in tuple(_alarms):
                if (failure := board()) is not None:
                    raise failure


def wait_event(event, what: str) -> None:
    """Wait for a recorded CUDA event (``cupy.cuda.Event``) within the job's limit: work
    queued behind an NCCL operation waits on the other ranks."""
    if _state["limit"] <= 0:
        event.synchronize()
        return
    poll_until(lambda: event.done, _state["limit"], what)
