"""Finished prompts on their way to world rank 0 while a generation runs, so that the partial
output file holds each one about a second after its last token, and a job killed outright (a
node lost, a scheduler's SIGKILL after its grace time) keeps them for ``--resume auto``; and
the end of a wave, where replicas that finished wait for the others.

Each replica's last stage (its tp rank 0, the *owner*) holds its rows' tokens. At most every
``interval`` seconds, at its next step, it sends the rows finished since its last message to
rank 0 in one non-blocking send of one int64 array (``pack``); rank 0 takes what has arrived at
its own steps. At the end of a wave every owner sends the rest with a final mark and rank 0
waits for every mark, so rank 0 then holds every finished row and no message is left in flight.

Replicas finish apart: one with longer prompts, or on a slower node, may run minutes after the
others. Those minutes are no hang, so the ranks that finished must not wait on a fixed
``--timeout``. They wait on evidence that the others still move: an owner's message doubles as
its replica's *heartbeat* (an empty one when no row finished for ``beat`` seconds), and rank 0,
which hears every owner, passes a *ping* on to the ranks of the replicas that finished, then a
*release* when the last final mark is in. Every wait is thus still bounded by ``--timeout``,
but counted from the last sign of life: a replica that truly stops (a rank stopped, a lost
node) stops its heartbeats, rank 0 stops its pings, and every waiting rank reports the hang.
"""

from __future__ import annotations

import os
from time import perf_counter
from typing import Callable

import numpy as np

from ..comm import Request
from ..config import ParallelConfig
from ..mesh import MeshCoords, rank_of

TAG_ROWS = 14
TAG_ALIVE = 15              # rank 0 -> waiting ranks: [0] a ping, [1] the release
SAVE_SECONDS = 1.0          # default interval; HPCPAR_SAVE_SECONDS overrides (0: every step)
HEARTBEAT_SECONDS = 1.0     # at least this often (and 4 per --timeout) a running replica says so

Receive = Callable[[np.ndarray, np.ndarray, np.ndarray], None]   # (prompts, tokens, lengths)


def save_interval() -> float:
    return float(os.environ.get("HPCPAR_SAVE_SECONDS", SAVE_SECONDS))


def owners(layout: ParallelConfig) -> list[int]:
    """The world rank holding each replica's results: its last stage's tp rank 0."""
    return [rank_of(MeshCoords(d, layout.pp - 1, 0), layout) for d in range(layout.dp)]


def replica_ranks(layout: ParallelConfig, dp_rank: int) -> list[int]:
    """The world ranks of replica ``dp_rank``."""
    return [rank_of(MeshCoords(dp_rank, p, t), layout)
            for p in range(layout.pp) for t in range(layout.tp)]


def pack(final: bool, prompts: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[final, n, prompts (n), lengths (n), tokens (n x max_new_tokens)] as one int64 array."""
    n = len(prompts)
    return np.concatenate([np.array([int(final), n]), prompts, lengths,
                           np.asarray(tokens).reshape(-1)]).astype(np.int64)


def unpack(message: np.ndarray, max_new_tokens: int):
    """``pack``'s (final, prompts, tokens, lengths)."""
    final, n = bool(message[0]), int(message[1])
    prompts, lengths = message[2:2 + n], message[2 + n:2 + 2 * n]
    tokens = message[2 + 2 * n:].reshape(n, max_new_tokens)
    return final, prompts, tokens, lengths


class FinishedRows:
    """One wave's stream. ``pump()`` at every step of the programs that own or collect rows
    (cheap until ``interval`` has passed), ``close()`` at the wave's end on every rank: it
    returns once every replica has finished."""

    def __init__(self, world, layout: ParallelConfig, program, max_new_tokens: int,
                 receive: Receive | None, interval: float):
        """``world``: the job's host communicator (its ``timeout`` is the job's);
        ``program``: this rank's generation program (``global_rows``, ``done``, ``tokens``,
        ``lengths``); ``receive``: rank 0's sink for finished rows."""
        self.world, self.layout, self.program, self.n = world, layout, program, max_new_tokens
        self.owners = owners(layout)
        self.owner = world.rank in self.owners
        self.senders = sum(1 for o in self.owners if o != 0)   # final marks rank 0 waits for
        self.receive = receive
        timeout = world.timeout
        self.beat = min(HEARTBEAT_SECONDS, timeout / 4) if timeout > 0 else float("inf")
        self.interval = min(interval, self.beat)
        self.sent = np.zeros(len(program.done), dtype=bool) if self.owner else None
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
        if self.owner:
            self._send(final=True)
        if self.world.rank == 0:
            self._take(wait=True)
            self._signal(self._others(), release=True)
        else:
            self._await_release()
        Request.wait_all(self.requests)

    # ---- the owners ------------------------------------------------------------------------

    def _send(self, final: bool) -> None:
        """The rows finished since the last message (rank 0 keeps its own); an empty message
        when none did for ``beat`` seconds (the heartbeat)."""
        p, now = self.program, perf_counter()
        new = p.done & ~self.sent
        self.sent |= new
        if self.world.rank == 0:
            if new.any():
                self.receive(p.global_rows[new], p.tokens[new], p.lengths[new])
            if final:
                self._finished(0)
            return
        if not new.any() and not final and now - self.last_sent < self.beat:
            return
        self.last_sent = now
        message = pack(final, p.global_rows[new], p.tokens[new], p.lengths[new])
        self._prune()
        self.requests.append(self.world.isend(message, 0, TAG_ROWS))

    # ---- rank 0 ------------------------------------------------------------------------------

    def _take(self, wait: bool) -> None:
        """What has arrived; ``wait``: until every other owner's final mark, each message
        (rows or a heartbeat) within ``--timeout`` of the one before."""
        while (arrived := self.world.probe(TAG_ROWS, np.int64, wait=wait and self.senders > 0,
                                           what="a heartbeat of the replicas still running")):
            source, count = arrived
            message = self.world.recv(np.empty(count, np.int64), source, TAG_ROWS)
            final, prompts, tokens, lengths = unpack(message, self.n)
            if len(prompts):
                self.receive(prompts, tokens, lengths)
            if final:
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

    def _others(self) -> list[int]:
        return [r for r in range(self.world.size) if r != 0]

    # ---- the ranks that wait -----------------------------------------------------------------

    def _await_release(self) -> None:
        """Rank 0's pings keep this wait alive (each within ``--timeout`` of the one before);
        its release ends it. Messages from one rank on one tag arrive in order, so no ping of
        this wave is left behind the release."""
        signal = np.empty(1, np.int64)
        while True:
            self.world.probe(TAG_ALIVE, np.int64, wait=True,
                             what="rank 0 to pass on a heartbeat of the replicas still running")
            self.world.recv(signal, 0, TAG_ALIVE)
            if signal[0]:
                return

    def _prune(self) -> None:
        self.requests = [r for r in self.requests if not r.test()]
