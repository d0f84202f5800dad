"""Where every rank is, for the hang report.

Each rank publishes the schedule action it is running (or waiting on) into a small window of
memory shared by the ranks of its node (``MPI.Win.Allocate_shared``). Reading it needs
nothing from the other ranks, so a rank whose receive or collective timed out (``--timeout``,
``CommTimeout``) can say where each rank of its node is even when one of them is stopped
(``kill -STOP``) or gone. Writing is a handful of integer stores per action.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .mesh import coords_of
from .pipeline.schedule import Action, Op

FIELDS = 9      # world rank, op code (-1: none), mb, step, peer (-1), chunk, since (ms), valid,
                # process id (the report says which rank is stopped or gone)
_OPS = list(Op)


class ActionBoard:
    def __init__(self, world, layout):
        """Collective over ``world``."""
        from mpi4py import MPI
        self.layout = layout
        self.node = world.Split_type(MPI.COMM_TYPE_SHARED)
        self.rank, self.size = self.node.Get_rank(), self.node.Get_size()
        itemsize = np.dtype(np.int64).itemsize
        # node rank 0 allocates the whole table (one row per rank, then a control row whose
        # first cell elects the rank that prints the report); every rank maps it
        nbytes = (self.size + 1) * FIELDS * itemsize if self.rank == 0 else 0
        self.win = MPI.Win.Allocate_shared(nbytes, itemsize, comm=self.node)
        buf, _ = self.win.Shared_query(0)
        full = np.ndarray((self.size + 1, FIELDS), dtype=np.int64, buffer=buf)
        self.table, self.control = full[:self.size], full[self.size]
        if self.rank == 0:
            self.control[:] = -1
        self.mine = self.table[self.rank]
        self.mine[:] = -1
        self.mine[0] = world.Get_rank()
        self.mine[8] = os.getpid()
        self.node.Barrier()

    def publish(self, a: Action) -> None:
        m = self.mine
        m[1], m[2], m[3] = _OPS.index(a.op), a.mb, a.step
        m[4] = -1 if a.peer is None else a.peer
        m[5], m[6], m[7] = a.chunk, int(time.monotonic() * 1000), 1

    def claim_report(self, settle: float = 0.05) -> bool:
        """Whether this rank prints the hang report: the ranks that time out together each
        write their number, and the last write stands (no atomics needed: after ``settle``
        seconds the cell no longer changes); a rank that comes later sees it taken."""
        if self.control[0] >= 0:
            return False
        self.control[0] = self.rank
        time.sleep(settle)
        return int(self.control[0]) == self.rank

    def report(self) -> list[str]:
        """One line per rank of this node: the action it is in, and for how long."""
        now = int(time.monotonic() * 1000)
        lines = []
        for row in self.table.copy():
            rank = int(row[0])
            c = coords_of(rank, self.layout)
            where = f"rank {rank} (dp {c.dp_rank}, pp {c.pp_rank}, tp {c.tp_rank})"
            where += _process_state(int(row[8]))
            if row[7] != 1:
                lines.append(f"{where}: not in the pipeline schedule (loading or collecting)")
                continue
            a = Action(_OPS[int(row[1])], int(row[2]), int(row[3]),
                       None if row[4] < 0 else int(row[4]), chunk=int(row[5]))
            lines.append(f"{where}: at {a} for {(now - int(row[6])) / 1000:.1f} s")
        return lines

    def free(self) -> None:
        self.win.Free()
        self.node.Free()


def _process_state(pid: int) -> str:
    """' [stopped]' or ' [gone]' for a rank whose process is not running, else ''."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return " [gone]"
    return {"T": " [stopped]", "t": " [stopped]", "Z": " [gone]"}.get(state, "")
