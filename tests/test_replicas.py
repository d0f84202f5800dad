"""The replicas' channel to rank 0 (hpcpar/jobs/replicas.py):
replicas that end seconds apart, more than the timeout, wait for each other on heartbeats and
lose no message; a replica that goes silent still ends every rank's wait with CommTimeout."""

import time

import numpy as np
import pytest

from hpcpar.parallel.comm import MpiCommunicator
from hpcpar.jobs.layout import ParallelConfig
from hpcpar.parallel.errors import CommTimeout
from hpcpar.jobs.replicas import ReplicaChannel, owners, replica_ranks

TIMEOUT = 0.6


def _layouts(size: int) -> list[ParallelConfig]:
    out = [ParallelConfig(dp=size)]
    if size % 4 == 0:
        out.append(ParallelConfig(dp=size // 4, pp=2, tp=2))
    elif size % 2 == 0:
        out.append(ParallelConfig(dp=size // 2, pp=2))
    return out


def _dp_rank(rank: int, layout: ParallelConfig) -> int:
    return rank // (layout.pp * layout.tp)


def test_owners_and_replica_ranks_cover_the_mesh():
    layout = ParallelConfig(dp=2, pp=3, tp=2)
    assert owners(layout) == [4, 10]                  # the last stage's tp rank 0
    assert replica_ranks(layout, 1) == list(range(6, 12))
    assert sorted(r for d in range(2) for r in replica_ranks(layout, d)) == list(range(12))


@pytest.mark.mpi(ranks=(8,))               # dp 8, and dp 2 x pp 2 x tp 2 (owners)
def test_replicas_that_end_apart_wait_on_heartbeats_and_lose_nothing(comm):
    world = MpiCommunicator(comm.Dup(), timeout=TIMEOUT)
    for layout in _layouts(world.size):
        if layout.dp < 2:
            continue
        d = _dp_rank(world.rank, layout)
        sent, got = [0], {r: [] for r in range(layout.dp)}

        def outgoing():                   # an owner's news: (replica, count) every other time
            sent[0] += 1
            return np.array([d, sent[0]], np.int64) if sent[0] % 2 else np.empty(0, np.int64)

        def deliver(body):
            got[int(body[0])].append(int(body[1]))

        channel = ReplicaChannel(world, layout, interval=0.02, outgoing=outgoing,
                                 deliver=deliver)
        start = time.monotonic()
        run = 2.5 * TIMEOUT * d / (layout.dp - 1)     # the last replica ends 1.5 s after the first
        while time.monotonic() - start < run:
            time.sleep(0.01)
            channel.pump()
        channel.close()
        # every rank waited for the last replica (a lower bound: load only adds to it)
        assert time.monotonic() - start >= 2.5 * TIMEOUT - 0.05
        counts = world.gather(np.array([[sent[0] if world.rank in owners(layout) else 0]]),
                              root=0)
        if world.rank == 0:
            for r, owner in enumerate(owners(layout)):
                n = int(counts[owner, 0])
                assert got[r] == list(range(1, n + 1, 2)), (r, got[r], n)
        world.barrier()


@pytest.mark.mpi(min_size=2)
def test_a_replica_that_goes_silent_ends_every_wait(comm):
    """The last replica stops pumping (a stopped rank sends nothing): rank 0 misses its
    heartbeats, the finished ranks miss rank 0's pings, and the silent one, when it comes
    back, finds no release: every rank gives up with CommTimeout (no clock is read: a loaded
    machine only makes it later, and a hang would meet the suite's own timeout)."""
    world = MpiCommunicator(comm.Dup(), timeout=TIMEOUT)
    layout = ParallelConfig(dp=world.size)
    channel = ReplicaChannel(world, layout)
    silent = world.size - 1
    if world.rank == silent:
        time.sleep(4 * TIMEOUT)
    with pytest.raises(CommTimeout, match="heartbeat of the replicas still running"):
        channel.close()
