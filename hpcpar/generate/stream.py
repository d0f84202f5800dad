"""Finished prompts on their way to world rank 0 while a generation runs, so that the partial
output file holds each one about a second after its last token, and a job killed outright (a
node lost, a scheduler's SIGKILL after its grace time) keeps them for ``--resume auto``.

Each replica's last stage (its tp rank 0) holds its rows' tokens. At most every ``interval``
seconds, at its next step, it sends the rows finished since its last message to rank 0 in one
non-blocking send of one int64 array (``pack``); rank 0 takes what has arrived at its own
steps. At the end of a wave every owner sends the rest with a final mark and rank 0 waits for
every mark, so rank 0 then holds every finished row and no message is left in flight.
``interval`` None: only that final message.
"""

from __future__ import annotations

import os
from time import perf_counter
from typing import Callable

import numpy as np

from ..comm import Request

TAG_ROWS = 14
SAVE_SECONDS = 1.0          # default interval; HPCPAR_SAVE_SECONDS overrides (0: every step)

Receive = Callable[[np.ndarray, np.ndarray, np.ndarray], None]   # (prompts, tokens, lengths)


def save_interval() -> float:
    return float(os.environ.get("HPCPAR_SAVE_SECONDS", SAVE_SECONDS))


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
    (cheap until ``interval`` has passed), ``close()`` at the wave's end on every rank."""

    def __init__(self, world, owners: list[int], program, max_new_tokens: int,
                 receive: Receive | None, interval: float | None):
        """``owners``: the world rank holding each replica's rows; ``program``: this rank's
        generation program (``global_rows``, ``done``, ``tokens``, ``lengths``);
        ``receive``: rank 0's sink for finished rows."""
        self.world, self.program, self.n = world, program, max_new_tokens
        self.owner = world.rank in owners
        self.senders = sum(1 for o in owners if o != 0)       # final marks rank 0 waits for
        self.receive, self.interval = receive, interval
        self.sent = np.zeros(len(program.done), dtype=bool) if self.owner else None
        self.requests: list[Request] = []
        self.last = perf_counter()

    def pump(self) -> None:
        if self.interval is None or perf_counter() - self.last < self.interval:
            return
        self.last = perf_counter()
        if self.owner:
            self._send(final=False)
        if self.world.rank == 0:
            self._take(wait=False)

    def close(self) -> None:
        if self.owner:
            self._send(final=True)
            Request.wait_all(self.requests)
        if self.world.rank == 0:
            self._take(wait=True)

    def _send(self, final: bool) -> None:
        """The rows finished since the last message (rank 0 keeps its own)."""
        p = self.program
        new = p.done & ~self.sent
        self.sent |= new
        if self.world.rank == 0:
            if new.any():
                self.receive(p.global_rows[new], p.tokens[new], p.lengths[new])
            return
        if not new.any() and not final:
            return
        message = pack(final, p.global_rows[new], p.tokens[new], p.lengths[new])
        self.requests = [r for r in self.requests if not r.test()]
        self.requests.append(self.world.isend(message, 0, TAG_ROWS))

    def _take(self, wait: bool) -> None:
        """Rank 0: what has arrived; ``wait``: until every other owner's final mark."""
        while (arrived := self.world.probe(TAG_ROWS, np.int64, wait=wait and self.senders > 0)):
            source, count = arrived
            message = self.world.recv(np.empty(count, np.int64), source, TAG_ROWS)
            final, prompts, tokens, lengths = unpack(message, self.n)
            self.senders -= final
            if len(prompts):
                self.receive(prompts, tokens, lengths)
            if wait and self.senders == 0:
                return
