"""The watchdog's alarm between nodes: a rank that finds the job hung tells the ranks of every
other node, whose bounded waits then give up at once instead of after their own timeout.
Nodes are played by blocks of ranks (``HPCPAR_FAKE_NODES``)."""

import time
from contextlib import contextmanager

import numpy as np
import pytest

from hpcpar.jobs.layout import ParallelConfig
from hpcpar.parallel.errors import CommTimeout, HangElsewhere


@contextmanager
def board_on(nodes: int, monkeypatch):
    """An ActionBoard over the world split into ``nodes`` fake nodes, its alarm listened to."""
    from mpi4py import MPI
    from hpcpar.parallel.device.waits import listen_for_alarm
    from hpcpar.jobs.watchdog import ActionBoard
    world = MPI.COMM_WORLD
    monkeypatch.setenv("HPCPAR_FAKE_NODES", str(nodes))
    board = ActionBoard(world, ParallelConfig(dp=world.Get_size()))
    assert board.nodes == nodes
    listen_for_alarm(board.alarm)
    try:
        yield board
    finally:
        listen_for_alarm(None)
    world.Barrier()
    board.free()


def wait_for_nothing(timeout: float, tag: int):
    """A bounded wait on a receive nobody sends; the receive is cancelled whatever happens."""
    from mpi4py import MPI
    from hpcpar.parallel.device.waits import wait_bounded
    never = MPI.COMM_WORLD.Irecv(np.empty(1), source=MPI.ANY_SOURCE, tag=tag)
    try:
        wait_bounded(never, timeout, "a receive that never completes")
    finally:
        never.Cancel()
        never.Wait()


@pytest.mark.mpi(min_size=2)
def test_an_alarm_from_another_node_ends_a_wait_at_once(monkeypatch):
    from mpi4py import MPI
    size = MPI.COMM_WORLD.Get_size()
    with board_on(size, monkeypatch) as board:          # every rank its own node
        if MPI.COMM_WORLD.Get_rank() == 0:
            board.sound_alarm()
        else:
            start = time.monotonic()
            with pytest.raises(HangElsewhere, match="rank 0 on another node"):
                wait_for_nothing(120.0, tag=99)
            assert time.monotonic() - start < 60


@pytest.mark.mpi(min_size=2)
def test_without_an_alarm_a_wait_ends_at_its_timeout(monkeypatch):
    with board_on(2, monkeypatch):
        with pytest.raises(CommTimeout, match="waited 0.5 s") as caught:
            wait_for_nothing(0.5, tag=98)
        assert not isinstance(caught.value, HangElsewhere)
