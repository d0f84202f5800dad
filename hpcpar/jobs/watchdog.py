"""Where every rank is, for the hang report.

Each rank publishes the schedule action it is running (or waiting on) into a small window of
memory shared by the ranks of its node (``MPI.Win.Allocate_shared``). Reading it needs
nothing from the other ranks, so a rank whose receive or collective timed out (``--timeout``,
``CommTimeout``) can say where each rank of its node is even when one of them is stopped
(``kill -STOP``) or gone. Writing is a handful of integer stores per action.

A node's memory is all one rank can read, so on several nodes each node prints its own part:
the rank that claims its node's report first sounds an *alarm* (a one-integer message to every
rank of the other nodes, each of which keeps a receive posted for it), and a rank that finds
the alarm while waiting gives up at once (``CommTimeout``), so every node whose ranks still
run reports within moments of the first, before the job is aborted. A stop request travels
the same way: a signal to one rank goes into its node's control row, which the node's ranks
read, and to every rank of the other nodes, which write it into their own rows when they poll.

``HPCPAR_FAKE_NODES=K`` (tests) splits the world into K blocks of consecutive ranks that play
the part of nodes.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import time

import numpy as np

from ..parallel.errors import Stopped
from ..parallel.pipeline.schedule import Action, Op
from .layout import describe_rank

FIELDS = 9      # world rank, op code (-1: none), mb, step, peer (-1), chunk, since (ms), state
                # (IN_ACTION, WAITING: for the other replicas, else: neither), process id
                # (the report says which rank is stopped or gone)
IN_ACTION, WAITING = 1, 2
STOP_SIGNAL, STOP_RANK = 1, 2   # the control row's cells of a stop request (0: the report's)
_OPS = list(Op)
_OP_INDEX = {op: i for i, op in enumerate(_OPS)}


class ActionBoard:
    def __init__(self, world, layout):
        """Collective over ``world``."""
        from mpi4py import MPI
        self.layout = layout
        self.node = _node_comm(world)
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
        self.stops_waits = False
        self._post_alarm(world)
        self.node.Barrier()

    # ---- the alarm between nodes ------------------------------------------------------------

    def _post_alarm(self, world) -> None:
        """Learn which world ranks share this node; post the receive for another's alarm."""
        from mpi4py import MPI
        nodes = np.empty(world.Get_size(), dtype=np.int64)
        leader = np.array([world.Get_rank() if self.rank == 0 else -1], dtype=np.int64)
        self.node.Bcast(leader, root=0)
        world.Allgather(leader, nodes)
        self.node_of = nodes                          # world rank -> its node's first rank
        self.nodes = len(set(nodes.tolist()))
        self.alarms = world.Dup()
        self._heard = np.full(1, -1, dtype=np.int64)
        self._listen = self.alarms.Irecv(self._heard, source=MPI.ANY_SOURCE, tag=_ALARM_TAG)
        self._stop_heard = np.full(2, -1, dtype=np.int64)     # (signal, world rank)
        self._stop_listen = self.alarms.Irecv(self._stop_heard, source=MPI.ANY_SOURCE,
                                              tag=_STOP_TAG)
        atexit.register(self._stop_listening)

    def alarm(self) -> int | Exception | None:
        """The world rank whose node declared the job hung, if an alarm came (cheap: one
        MPI test); while ``stops_waits`` (a phase with no step to stop at), a stop asked on
        this node, as ``Stopped``."""
        if self._listen is not None and self._listen.Test():
            self._listen = None
        if self.stops_waits and (asked := self.stop_asked()) is not None:
            return Stopped(signal.Signals(asked[0]).name, asked[1])
        return None if self._heard[0] < 0 else int(self._heard[0])

    def sound_alarm(self) -> None:
        """Tell every rank of the other nodes that this one found the job hung (without
        waiting: some may be stopped)."""
        self._tell_other_nodes(self.mine[:1].copy(), _ALARM_TAG)   # this rank's world rank

    def _tell_other_nodes(self, message: np.ndarray, tag: int) -> None:
        here = self.node_of[self.mine[0]]
        self._sent = getattr(self, "_sent", []) + [
            self.alarms.Isend(message, dest=r, tag=tag)
            for r in range(len(self.node_of)) if self.node_of[r] != here]

    # ---- a stop request, seen by every rank of the node ---------------------------------------

    def ask_stop(self, signum: int) -> None:
        """This rank got a stop signal: the node's control row says so (its first asker
        stays), so its ranks that poll ``stop_asked`` stop too, whichever rank got it; and
        the first asker of a node tells every rank of the other nodes (a message each keeps
        a receive posted for), which write it into their own nodes' rows when they poll."""
        if self.control[STOP_SIGNAL] <= 0:
            self._note_stop(signum, int(self.mine[0]))
            if self.nodes > 1:
                self._tell_other_nodes(np.array([signum, self.mine[0]], dtype=np.int64),
                                       _STOP_TAG)

    def stop_asked(self) -> tuple[int, int] | None:
        """(signal number, world rank that got it) if a rank of this node asked to stop, or
        one of another node did (its message, received here: one MPI test)."""
        signum = int(self.control[STOP_SIGNAL])
        if signum <= 0 and self._stop_listen is not None and self._stop_listen.Test():
            self._stop_listen = None
            self._note_stop(int(self._stop_heard[0]), int(self._stop_heard[1]))
            signum = int(self.control[STOP_SIGNAL])
        return (signum, int(self.control[STOP_RANK])) if signum > 0 else None

    def _note_stop(self, signum: int, world_rank: int) -> None:
        if self.control[STOP_SIGNAL] <= 0:
            self.control[STOP_RANK] = world_rank
            self.control[STOP_SIGNAL] = signum

    def _stop_listening(self) -> None:
        for name in ("_listen", "_stop_listen"):
            request = getattr(self, name, None)
            if request is not None:
                request.Cancel()
                request.Wait()
                setattr(self, name, None)

    # ---- actions ----------------------------------------------------------------------------

    def publish(self, a: Action, step: int | None = None) -> None:
        """This rank is at action ``a``; ``step``: a training step's number (its schedule's
        actions carry none: the report names it as the action's step)."""
        m = self.mine
        m[1], m[2], m[3] = _OP_INDEX[a.op], a.mb, a.step if step is None else step
        m[4] = -1 if a.peer is None else a.peer
        m[5], m[6], m[7] = a.chunk, int(time.monotonic() * 1000), IN_ACTION

    def publish_waiting(self) -> None:
        """This rank's replica is done with its rows; it waits for the other replicas."""
        self.mine[6], self.mine[7] = int(time.monotonic() * 1000), WAITING

    def leave_schedule(self) -> None:
        self.mine[7] = -1

    def claim_report(self, settle: float = 0.05) -> bool:
        """Whether this rank prints the hang report: the ranks that time out together each
        write their number, and the last write stands (no atomics needed: after ``settle``
        seconds the cell no longer changes); a rank that comes later sees it taken."""
        if self.control[0] >= 0:
            return False
        self.control[0] = self.rank
        time.sleep(settle)
        return int(self.control[0]) == self.rank

    def heading(self) -> str:
        return f"Where the ranks of node {socket.gethostname()} are"

    def report(self) -> list[str]:
        """One line per rank of this node: the action it is in, and for how long."""
        now = int(time.monotonic() * 1000)
        lines = []
        for row in self.table.copy():
            rank = int(row[0])
            where = describe_rank(rank, self.layout)
            where += _process_state(int(row[8]))
            since = f"for {(now - int(row[6])) / 1000:.1f} s"
            if row[7] == WAITING:
                lines.append(f"{where}: done, waiting for the other replicas {since}")
                continue
            if row[7] != IN_ACTION:
                lines.append(f"{where}: not in the pipeline schedule (loading or collecting)")
                continue
            a = Action(_OPS[int(row[1])], int(row[2]), int(row[3]),
                       None if row[4] < 0 else int(row[4]), chunk=int(row[5]))
            lines.append(f"{where}: at {a} {since}")
        return lines

    def free(self) -> None:
        self._stop_listening()
        for req in getattr(self, "_sent", ()):
            req.Wait()
        self.alarms.Free()
        self.win.Free()
        self.node.Free()


_ALARM_TAG = 7
_STOP_TAG = 8


def _node_comm(world):
    """The ranks that share this rank's memory (``HPCPAR_FAKE_NODES``: blocks of the world)."""
    from mpi4py import MPI

    from .settings import environment_value
    fake = environment_value("HPCPAR_FAKE_NODES", world.Get_size())
    if fake is not None:
        per_node = -(-world.Get_size() // fake)
        return world.Split(world.Get_rank() // per_node, world.Get_rank())
    return world.Split_type(MPI.COMM_TYPE_SHARED)


def _process_state(pid: int) -> str:
    """' [stopped]' or ' [gone]' for a rank whose process is not running, else ''."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return " [gone]"
    return {"T": " [stopped]", "t": " [stopped]", "Z": " [gone]"}.get(state, "")
