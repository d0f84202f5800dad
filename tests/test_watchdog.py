"""The watchdog's alarm between nodes: a rank that finds the job hung tells the ranks of every
other node, whose bounded waits then give up at once instead of after their own timeout.
Nodes are played by single ranks (``HPCPAR_FAKE_NODES``)."""

import time

import numpy as np
import pytest

from hpcpar.config import ParallelConfig
from hpcpar.errors import HangElsewhere


@pytest.mark.mpi(min_size=2)
def test_an_alarm_from_another_node_ends_a_wait_at_once(monkeypatch):
    from mpi4py import MPI
    from hpcpar.comm.mpi import wait_bounded
    from hpcpar.waits import listen_for_alarm
    from hpcpar.watchdog import ActionBoard
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    monkeypatch.setenv("HPCPAR_FAKE_NODES", str(size))
    board = ActionBoard(world, ParallelConfig(dp=size))
    assert board.nodes == size and board.size == 1
    listen_for_alarm(board.alarm)
    try:
        if rank == 0:
            board.sound_alarm(0)
        else:
            never = world.Irecv(np.empty(1), source=0, tag=99)
            start = time.monotonic()
            with pytest.raises(HangElsewhere, match="rank 0 on another node"):
                wait_bounded(never, 120.0, "a receive that never completes")
            assert time.monotonic() - start < 60
            never.Cancel()
            never.Wait()
    finally:
        listen_for_alarm(None)
    world.Barrier()
    board.free()


@pytest.mark.mpi(min_size=2)
def test_without_an_alarm_a_wait_ends_at_its_timeout(monkeypatch):
    from mpi4py import MPI
    from hpcpar.comm.mpi import wait_bounded
    from hpcpar.waits import listen_for_alarm
    from hpcpar.errors import CommTimeout
    from hpcpar.watchdog import ActionBoard
    world = MPI.COMM_WORLD
    monkeypatch.setenv("HPCPAR_FAKE_NODES", "2")
    board = ActionBoard(world, ParallelConfig(dp=world.Get_size()))
    assert board.nodes == 2
    listen_for_alarm(board.alarm)
    try:
        never = world.Irecv(np.empty(1), source=MPI.ANY_SOURCE, tag=98)
        with pytest.raises(CommTimeout, match="waited 0.5 s") as caught:
            wait_bounded(never, 0.5, "a receive that never completes")
        assert not isinstance(caught.value, HangElsewhere)
        never.Cancel()
        never.Wait()
    finally:
        listen_for_alarm(None)
    world.Barrier()
    board.free()
