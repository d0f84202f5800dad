"""Saving training checkpoints: every rank at once, in the background if asked
(``train.async_save``), or one rank at a time into one file (``train.serial_save``).

    save(step S)  the previous write waited for and committed; then every writer's slices
                  (``checkpoint.my_regions``) into its part file, at once; rank 0 commits
                  (the top file, the renames, ``latest``) once every part is complete
    async         the slices copied to host memory (a snapshot: the next steps change the
                  weights), then written by a thread while training goes on. ``poll``, at
                  the end of every step while a write is pending, agrees over MPI whether
                  every rank's thread finished, and commits then; ``wait`` (the next save,
                  the last step, a stop) blocks until it has.

MPI calls stay on the main thread, unless the library is thread-multiple
(``MPI.Query_thread()``, mpi4py's default request): then each thread agrees with the
others' on a communicator of its own as soon as its part is written, and rank 0's thread
commits at once, without waiting for the next step boundary. A failed write on any rank
(a full disk, an error) is one error on every rank at the next ``poll`` or ``wait``; the
previous checkpoint and ``latest`` stay as they were.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from ...checkpoint.files import is_write_failure, write_failure
from ...checkpoint.parts import part_name, write_part
from ...parallel.errors import HpcparError
from ..launch import JobFailed, everyone
from . import checkpoint as tc

POLL_SECONDS = 0.01             # a thread's wait between tests of its agreement


class CheckpointSaver:
    """The checkpoints of one training run on every rank of ``comm`` (``world``: the same
    ranks as a bounded ``Communicator`` for the per-step agreement)."""

    def __init__(self, comm, world, source, cfg, tp_rank: int, tp_size: int, to_host,
                 serial: bool = False, background: bool = False):
        from mpi4py import MPI
        self.comm, self.world, self.source, self.cfg = comm, world, source, cfg
        self.tp_rank, self.tp_size, self.to_host = tp_rank, tp_size, to_host
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.serial, self.background = serial, background and not serial
        self.threaded = (self.background and self.size > 1
                         and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        self.agree_comm = comm.Dup() if self.threaded else None
        self.pending: _Write | None = None

    # ---- the engine's calls (collective: every rank, at the same steps) -----------------

    def save(self, path: Path, held, optimizer, attrs: dict, final: bool = False) -> None:
        """The checkpoint ``path`` of the run's state now; ``final`` (the last step, a
        stop): written before it returns, whatever the mode."""
        self.wait()
        states = {name: {k: st[k] for k in optimizer.state_names}    # the step: an attribute
                  for name, st in optimizer.state_dict().items()}
        names = optimizer.state_names
        if self.serial:
            return self._save_serial(path, held, states, names, attrs)
        everyone(self.comm, lambda: self.rank != 0 or tc.prepare_parts(path, self.source, names))
        background = self.background and not final
        regions = tc.my_regions(held, states, self.cfg, self.tp_rank, self.tp_size,
                                self.to_host, copy=background)
        write = _Write(path, regions, lambda: tc.commit_parts(path, self.source, names, attrs),
                       self.rank, self.agree_comm if background else None)
        if background:
            self.pending = write
            write.start()
            return
        try:
            write.attempt(write.write_part)
            everyone(self.comm, write.outcome)
            if self.rank == 0:
                write.attempt(write.commit)
            everyone(self.comm, write.outcome)
        except JobFailed:
            if self.rank == 0:
                tc.discard(path)
            raise

    def poll(self) -> None:
        """At a step's end: a background write every rank finished is committed now (one
        small AllReduce while one is pending; nothing otherwise)."""
        if self.pending is None:
            return
        done = np.array([0.0 if self.pending.thread.is_alive() else 1.0])
        self.world.all_reduce(done)
        if int(done[0]) == self.size:
            self._settle()

    def wait(self) -> None:
        """The pending background write finished and committed (or its failure raised on
        every rank)."""
        if self.pending is not None:
            self.pending.thread.join()
            self._settle()

    def close(self) -> None:
        """The run ends (normally or not): a write still in flight is abandoned (its
        temporary files are the next run's to remove; ``latest`` is unchanged)."""
        if self.pending is not None:
            self.pending.cancel.set()
            self.pending.thread.join(timeout=60)
            self.pending = None
        elif self.agree_comm is not None:
            self.agree_comm.Free()
        self.agree_comm = None

    def check_memory(self, held, state_names) -> None:
        """--async-save: the snapshot of every rank of this node fits its free host memory
        (``MemAvailable``), or one error before the first step (collective)."""
        if not self.background:
            return
        from mpi4py import MPI
        with_state = np.array([tc.snapshot_bytes(held, self.cfg, self.tp_rank, self.tp_size,
                                                 len(state_names))], np.float64)
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        node.Allreduce(MPI.IN_PLACE, with_state)
        node.Free()
        free = available_memory()

        def check():
            if free is not None and with_state[0] > free:
                raise HpcparError(
                    f"--async-save: a snapshot of this node's ranks needs "
                    f"{with_state[0] / 1e6:,.0f} MB of host memory and {free / 1e6:,.0f} MB "
                    "are available; save without --async-save, or spread the ranks over "
                    "more nodes")
        everyone(self.comm, check)

    # ---- inside -------------------------------------------------------------------------

    def _settle(self) -> None:
        """Every rank's thread has finished: its failure (any rank's) raised on all, else the
        commit (rank 0; already done by its thread when thread-multiple)."""
        write, self.pending = self.pending, None
        try:
            everyone(self.comm, write.outcome)
            if write.agree is None:
                if self.rank == 0:
                    write.attempt(write.commit)
                everyone(self.comm, write.outcome)
        except JobFailed:
            if self.rank == 0:
                tc.discard(write.path)
            raise

    def _save_serial(self, path, held, states, names, attrs) -> None:
        """One file, the ranks' slices written in turn (rank 0 creates and commits it)."""
        rank, cfg, to_host = self.rank, self.cfg, self.to_host

        def create():
            if rank == 0:
                path.parent.mkdir(exist_ok=True)
                tc.create_file(path, self.source, names, attrs)

        def write_mine():
            tc.write_regions(path, tc.my_regions(held, states, cfg, self.tp_rank, self.tp_size,
                                                 to_host, copy=False))

        try:
            everyone(self.comm, create)
            for r in range(self.size):
                everyone(self.comm, write_mine if r == rank else lambda: None)
            everyone(self.comm, lambda: rank != 0 or tc.commit(path))
        except JobFailed:
            if rank == 0:
                tc.discard(path)
            raise


class _Write:
    """One rank's part of one checkpoint: written now (``write_part``) or by a thread
    (``start``), which with ``agree`` (a communicator of its own) also agrees with the other
    ranks' threads and, on rank 0, commits."""

    def __init__(self, path: Path, regions, commit, rank: int, agree):
        self.path, self.regions, self.commit_fn, self.rank = path, regions, commit, rank
        self.agree = agree
        self.error: BaseException | None = None
        self.trace = ""
        self.committed = False
        self.cancel = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"saving {path.name}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def write_part(self) -> None:
        if self.regions:
            write_part(tc.tmp_parts(self.path) / part_name(self.rank), self.regions,
                       self.cancel.is_set, self.path)
        self.regions = []                 # the snapshot's memory, freed

    def commit(self) -> None:
        if not self.committed:
            self.commit_fn()
            self.committed = True

    def attempt(self, fn) -> None:
        """``fn()``, its failure kept for ``outcome`` (this thread may not be the one that
        reports it)."""
        try:
            fn()
        except Exception as e:           # a second Ctrl-C (KeyboardInterrupt) goes through
            self.error = e
            if not (isinstance(e, HpcparError) or is_write_failure(e)):
                self.trace = traceback.format_exc()        # a bug: its traceback, once

    def outcome(self) -> None:
        """Raise this rank's failure of the write (or of the commit), as one error that
        says the checkpoint was not written and which one ``latest`` still names."""
        e = self.error
        if e is None:
            return
        if self.trace:
            print(self.trace, file=sys.stderr, flush=True)
        latest = self.path.parent / tc.LATEST
        kept = (f"{latest} still names {latest.read_text().strip()}" if latest.exists()
                else "no earlier checkpoint of this run")
        what = (str(e) if isinstance(e, HpcparError) else
                str(write_failure(self.path, e)) if is_write_failure(e) else
                f"{type(e).__name__}: {e}")
        raise HpcparError(f"saving {self.path} failed: {what}; it was not written ({kept})")

    def _run(self) -> None:
        _lower_priority()                 # training's compute goes first
        self.attempt(self.write_part)     # kept for the main thread, which raises it on all
        if self.agree is None or self.cancel.is_set():
            return
        from mpi4py import MPI
        failed = np.array([0 if self.error is None else 1], np.int64)
        request = self.agree.Iallreduce(MPI.IN_PLACE, failed, op=MPI.SUM)
        while not request.Test():
            if self.cancel.is_set():
                return
            time.sleep(POLL_SECONDS)
        if failed[0] == 0 and self.rank == 0:
            self.attempt(self.commit)
        # another rank's part failed: that rank raises it (``outcome``); nothing is committed


def available_memory() -> int | None:
    """The host memory available to new allocations (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _lower_priority() -> None:
    """This thread at the lowest CPU priority (Linux: a thread's own nice value), so a
    background write takes the cycles the training leaves (its waits), not its compute's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
