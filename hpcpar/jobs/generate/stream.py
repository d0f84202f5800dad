"""Finished prompts on their way to world rank 0 while a generation runs, so that the partial
output file holds each one about a second after its last token, and a job killed outright (a
node lost, a scheduler's SIGKILL after its grace time) keeps them for ``--resume auto``.

Each replica's owner (its last stage, tp rank 0) holds its rows' tokens; at most every
``interval`` seconds it sends the rows finished since its last message to rank 0 over the
wave's ``ReplicaChannel`` (``RowResults.pack``), whose messages double as the replica's heartbeats. At the
end of a wave rank 0 holds every finished row, and every rank has waited for every replica.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..layout import ParallelConfig
from ..replicas import ReplicaChannel
from ..settings import environment_number
from .results import RowResults

Receive = Callable[[np.ndarray, RowResults], None]   # (prompts, their results)


def save_interval() -> float:
    """Seconds between a replica's messages: ``HPCPAR_SAVE_SECONDS`` (default 1; 0: every
    step)."""
    return environment_number("HPCPAR_SAVE_SECONDS")


class FinishedRows:
    """One wave's stream. ``pump()`` at every step of the programs that own or collect rows
    (cheap until ``interval`` has passed), ``close()`` at the wave's end on every rank: it
    returns once every replica has finished the wave. The channel's callbacks close over the
    program, not over this stream: through its channel the stream would refer to itself, and
    the program with its model would outlive the run until Python's cycle collector ran."""

    def __init__(self, world, layout: ParallelConfig, board, program,
                 receive: Receive | None, interval: float,
                 heard: Callable[[int, int], None] | None = None):
        """``program``: this rank's generation program (``global_rows``, ``done``,
        ``results``, ``worked``); ``receive``: rank 0's sink for finished rows;
        ``heard(dp_rank, tokens)``: rank 0's sink for each replica's tokens done."""
        self.program = program
        sent = np.zeros(len(program.done), dtype=bool)

        def new_rows() -> np.ndarray:
            """The rows finished since the last message, packed (empty: none)."""
            new = program.done & ~sent
            if not new.any():
                return np.empty(0, np.int64)
            np.logical_or(sent, new, out=sent)
            return program.results.take(new).pack(program.global_rows[new])

        def deliver(body: np.ndarray) -> None:
            receive(*RowResults.unpack(body, program.results.shape))

        self.channel = ReplicaChannel(world, layout, board, interval, new_rows, deliver,
                                      lambda: program.worked, heard)
        self.pump, self.close = self.channel.pump, self.channel.close
