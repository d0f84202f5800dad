"""Finished prompts on their way to world rank 0 while a generation runs, so that the partial
output file holds each one about a second after its last token, and a job killed outright (a
node lost, a scheduler's SIGKILL after its grace time) keeps them for ``--resume auto``.

Each replica's owner (its last stage, tp rank 0) holds its rows' tokens; at most every
``interval`` seconds it sends the rows finished since its last message to rank 0 over the
wave's ``ReplicaChannel`` (``pack``), whose messages double as the replica's heartbeats. At the
end of a wave rank 0 holds every finished row, and every rank has waited for every replica.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..layout import ParallelConfig
from ..replicas import ReplicaChannel
from ..settings import environment_number

Receive = Callable[[np.ndarray, np.ndarray, np.ndarray], None]   # (prompts, tokens, lengths)


def save_interval() -> float:
    """Seconds between a replica's messages: ``HPCPAR_SAVE_SECONDS`` (default 1; 0: every
    step)."""
    return environment_number("HPCPAR_SAVE_SECONDS")


def pack(prompts: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[n, prompts (n), lengths (n), tokens (n x max_new_tokens)] as one int64 array."""
    n = len(prompts)
    return np.concatenate([np.array([n]), prompts, lengths,
                           np.asarray(tokens).reshape(-1)]).astype(np.int64)


def unpack(message: np.ndarray, max_new_tokens: int):
    """``pack``'s (prompts, tokens, lengths)."""
    n = int(message[0])
    prompts, lengths = message[1:1 + n], message[1 + n:1 + 2 * n]
    tokens = message[1 + 2 * n:].reshape(n, max_new_tokens)
    return prompts, tokens, lengths


class FinishedRows:
    """One wave's stream. ``pump()`` at every step of the programs that own or collect rows
    (cheap until ``interval`` has passed), ``close()`` at the wave's end on every rank: it
    returns once every replica has finished the wave."""

    def __init__(self, world, layout: ParallelConfig, board, program, max_new_tokens: int,
                 receive: Receive | None, interval: float,
                 heard: Callable[[int, int], None] | None = None):
        """``program``: this rank's generation program (``global_rows``, ``done``,
        ``tokens``, ``lengths``, ``worked``); ``receive``: rank 0's sink for finished rows;
        ``heard(dp_rank, tokens)``: rank 0's sink for each replica's tokens done."""
        self.program, self.n, self.receive = program, max_new_tokens, receive
        self.sent = np.zeros(len(program.done), dtype=bool)
        self.channel = ReplicaChannel(world, layout, board, interval, self._new_rows,
                                      self._deliver, lambda: program.worked, heard)
        self.pump, self.close = self.channel.pump, self.channel.close

    def _new_rows(self) -> np.ndarray:
        """The rows finished since the last message, packed (empty: none)."""
        p = self.program
        new = p.done & ~self.sent
        if not new.any():
            return np.empty(0, np.int64)
        self.sent |= new
        return pack(p.global_rows[new], p.tokens[new], p.lengths[new])

    def _deliver(self, body: np.ndarray) -> None:
        self.receive(*unpack(body, self.n))
