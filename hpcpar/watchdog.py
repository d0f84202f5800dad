"""Where every rank is, for the hang report.

Each rank publishes the schedule action it is running (or waiting on) into a small window of
memory shared by the ranks of its node (``MPI.Win.Allocate_shared``). Reading it needs
nothing from the other ranks, so a rank whose receive or collective timed out (``--timeout``,
``CommTimeout``) can say where each rank of its node is even when one of them is stopped
(``kill -STOP``) or gone. Writing is a handful of integer stores per action.
"""

from __future__ import annotations

import time

import numpy as np

from .mesh import coords_of
from .pipeline.schedule import Action, Op

FIELDS = 8      # world rank, op code (-1: none), mb, step, peer (-1), chunk, since (ms), valid
_OPS = list(Op)


class ActionBoard:
    def __init__(self, world, layout):
        """Collective over ``world``."""
        from mpi4py import MPI
        self.layout = layout
        self.node = world.Split_type(MPI.COMM_TYPE_SHARED)
        self.rank, self.size = self.node.Get_rank(), self.node.Get_size()
        itemsize = np.dtype(np.int64).itemsize
        # node rank 0 allocates the whole table; every rank maps it
        nbytes = self.size * FIELDS * itemsize if self.rank == 0 else 0
        self.win = MPI.Win.Allocate_shared(nbytes, itemsize, comm=self.node)
        buf, _ = self.win.Shared_query(0)
        self.table = np.ndarray((self.size, FIELDS), dtype=np.int64, buffer=buf)
        self.mine = self.table[self.rank]
        self.mine[:] = -1
        self.mine[0] = world.Get_rank()
        self.node.Barrier()

    def publish(self, a: Action) -> None:
        m = self.mine
        m[1], m[2], m[3] = _OPS.index(a.op), a.mb, a.step
        m[4] = -1 if a.peer is None else a.peer
        m[5], m[6], m[7] = a.chunk, int(time.monotonic() * 1000), 1

    def report(self) -> list[str]:
        """One line per rank of this node: the action it is in, and for how long."""
        now = int(time.monotonic() * 1000)
        lines = []
        for row in self.table.copy():
            rank = int(row[0])
            c = coords_of(rank, self.layout)
            where = f"rank {rank} (dp {c.dp_rank}, pp {c.pp_rank}, tp {c.tp_rank})"
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
