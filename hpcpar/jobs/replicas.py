"""Replicas that run apart: messages from each replica to rank 0 while a forward-only job
(generation, scoring) runs, and the end of the run, where the replicas that finished wait for
the others.

Each replica's *owner* (its last stage's tp rank 0, which holds the replica's results) sends
rank 0, at most every ``interval`` seconds at its next step, what it has new (``outgoing``: an
int64 array, possibly empty) and how far it is (``progress``: tokens done, for rank 0's
progress display), in one non-blocking send; rank 0 hands each body to ``deliver`` and each
count to ``heard`` as it takes the messages at its own steps. At the end every owner sends the rest with a final
mark and rank 0 waits for every mark, so no message is left in flight.

Replicas finish apart: one with longer rows, or on a slower node, may run minutes after the
others. Those minutes are no hang, so the ranks that finished must not wait on a fixed
``--timeout``. They wait on evidence that the others still move: an owner's message doubles as
its replica's *heartbeat* (an empty one when it had nothing to say for ``beat`` seconds), and
rank 0, which hears every owner, passes a *ping* on to the ranks of the replicas that finished,
then a *release* when the last final mark is in. Every wait is thus still bounded by
``--timeout``, but counted from the last sign of life: a replica that truly stops (a rank
stopped, a lost node) stops its heartbeats, rank 0 stops its pings, and every waiting rank
reports the hang.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable

import numpy as np

from ..parallel.comm import Request
from .launch import phase
from .layout import MeshCoords, ParallelConfig, rank_of

TAG_REPLICA = 14            # owner -> rank 0: [final, progress, body...]
TAG_ALIVE = 15              # rank 0 -> waiting ranks: [0] a ping, [1] the release
HEARTBEAT_SECONDS = 1.0     # at least this often (and 4 times per --timeout) a replica says so
PROGRESS_SECONDS = 0.5      # a replica's new progress alone is sent at most this often


def owners(layout: ParallelConfig) -> list[int]:
    """The world rank holding each replica's results: its last stage's cp and tp rank 0."""
    return [rank_of(MeshCoords(d, layout.pp - 1, 0), layout) for d in range(layout.dp)]


def replica_ranks(layout: ParallelConfig, dp_rank: int) -> list[int]:
    """The world ranks of replica ``dp_rank``."""
    return [rank_of(MeshCoords(dp_rank, p, t, c), layout)
            for p in range(layout.pp) for c in range(layout.cp) for t in range(layout.tp)]


class ReplicaChannel:
    """One run's channel. ``pump()`` at every step of the ranks that own results, and of rank
    0 (cheap until ``interval`` has passed); ``close()`` on every rank at the run's end: it
    returns once every replica has finished."""

    def __init__(self, world, layout: ParallelConfig, board=None,
                 interval: float = HEARTBEAT_SECONDS,
                 outgoing: Callable[[], np.ndarray] | None = None,
                 deliver: Callable[[np.ndarray], None] | None = None,
                 progress: Callable[[], int] | None = None,
                 heard: Callable[[int, int], None] | None = None):
        """``world``: the job's host communicator (its ``timeout`` is the job's);
        ``board``: the job's ``watchdog.ActionBoard`` (a hang report says who waits);
        ``outgoing()``: an owner's new results (an int64 array, empty: nothing new);
        ``deliver(body)``: rank 0's sink for them (its own replica's too, when it owns one);
        ``progress()``: an owner's count of its replica's work done (tokens);
        ``heard(dp_rank, count)``: rank 0's sink for those counts."""
        self.world, self.layout, self.board = world, layout, board
        self.outgoing, self.deliver = outgoing, deliver
        self.progress, self.heard = progress, heard
        self.counted = 0                     # the count an owner sent last
        self.owners = owners(layout)
        self.owner = world.rank in self.owners
        self.senders = sum(1 for o in self.owners if o != 0)   # final marks rank 0 waits for
        timeout = world.timeout
        self.beat = min(HEARTBEAT_SECONDS, timeout / 4) if timeout > 0 else float("inf")
        self.interval = min(interval, self.beat)
        self.requests: list[Request] = []
        self.waiting: list[int] = []         # rank 0: the ranks of replicas that finished
        self.last = self.last_sent = self.last_ping = perf_counter()

    def pump(self) -> None:
        now = perf_counter()
        if now - self.last < self.interval:
            return
        self.last = now
        if self.owner:
            self._send(final=False)
        if self.world.rank == 0:
            self._take(wait=False)
            self._ping()

    def close(self) -> None:
        if self.board is not None:
            self.board.publish_waiting()
        with phase("waiting for every replica to finish"):
            if self.owner:
                self._send(final=True)
            if self.world.rank == 0:
                self._take(wait=True)
                self._signal([r for r in range(self.world.size) if r != 0], release=True)
            else:
                self._await_release()
            Request.wait_all(self.requests)
        if self.board is not None:
            self.board.leave_schedule()

    # ---- the owners ------------------------------------------------------------------------

    def _send(self, final: bool) -> None:
        """What is new (rank 0 keeps its own); the progress alone when it moved, and an empty
        message when nothing did for ``beat`` seconds (the heartbeat)."""
        now = perf_counter()
        body = self.outgoing() if self.outgoing is not None else np.empty(0, np.int64)
        count = self.progress() if self.progress is not None else 0
        if self.world.rank == 0:
            if len(body):
                self.deliver(body)
            if self.heard is not None:
                self.heard(0, count)
            if final:
                self._finished(0)
            return
        quiet = now - self.last_sent
        moved = count != self.counted and quiet >= PROGRESS_SECONDS
        if not len(body) and not final and not moved and quiet < self.beat:
            return
        self.last_sent, self.counted = now, count
        self._prune()
        message = np.concatenate([[int(final), count], body]).astype(np.int64)
        self.requests.append(self.world.isend(message, 0, TAG_REPLICA))

    # ---- rank 0 ------------------------------------------------------------------------------

    def _take(self, wait: bool) -> None:
        """What has arrived; ``wait``: until every other owner's final mark, each message
        (results or a heartbeat) within ``--timeout`` of the one before."""
        while (arrived := self.world.probe(TAG_REPLICA, np.int64,
                                           wait=wait and self.senders > 0,
                                           what="a heartbeat of the replicas still running")):
            source, count = arrived
            message = self.world.recv(np.empty(count, np.int64), source, TAG_REPLICA)
            if self.heard is not None:
                self.heard(self.owners.index(source), int(message[1]))
            if count > 2:
                self.deliver(message[2:])
            if message[0]:
                self.senders -= 1
                self._finished(self.owners.index(source))
            self._ping()
            if wait and self.senders == 0:
                return

    def _finished(self, dp_rank: int) -> None:
        self.waiting += [r for r in replica_ranks(self.layout, dp_rank) if r != 0]

    def _ping(self) -> None:
        """Tell the ranks that wait that the other replicas still run (every ``beat``)."""
        now = perf_counter()
        if self.waiting and now - self.last_ping >= self.beat:
            self.last_ping = now
            self._signal(self.waiting, release=False)

    def _signal(self, ranks: list[int], release: bool) -> None:
        self._prune()
        for r in ranks:
            self.requests.append(self.world.isend(np.array([int(release)], np.int64), r,
                                                  TAG_ALIVE))

    # ---- the ranks that wait -----------------------------------------------------------------

    def _await_release(self) -> None:
        """Rank 0's pings keep this wait alive (each within ``--timeout`` of the one before);
        its release ends it. Messages from one rank on one tag arrive in order, so no ping of
        this run is left behind the release."""
        signal = np.empty(1, np.int64)
        while True:
            self.world.probe(TAG_ALIVE, np.int64, wait=True,
                             what="rank 0 to pass on a heartbeat of the replicas still running")
            self.world.recv(signal, 0, TAG_ALIVE)
            if signal[0]:
                return

    def _prune(self) -> None:
        self.requests = [r for r in self.requests if not r.test()]
