"""The skeleton every job runs on, written once: generation, scoring and training are each a
``JobRun`` whose steps they fill in.

    setup      open the checkpoint and validate the job, agreed by every rank; the timeout
    claim      one writer holds the output (a file, or a folder) while the job runs
    open       this rank's place in the mesh, its device, communicators and weights
    work       the job's loop, under a stop request (SIGTERM / SIGUSR1 / Ctrl-C)
    finish     collect on rank 0, report, write the output, free the communicators

A stop is seen where each job can act on it: generation at the end of a wave, training at
its next step (both save what is finished and leave with ``EXIT_PREEMPTED`` through
``preempted``), scoring at its next micro-batch or wait (``Stopped``: nothing is written,
every rank leaves together). A new job kind is one small module: a subclass that writes
``validate``, ``open``, ``work`` and ``finish``.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from .. import __version__
from ..checkpoint import Checkpoint, open_checkpoint
from ..parallel.device import waits
from ..parallel.device.dtypes import dtype_name
from ..parallel.errors import CommTimeout, Stopped
from ..parallel.ops import check_ops
from .job import Job
from .launch import EXIT_PREEMPTED, JobFailed, StopRequest, everyone, phase, set_timeout
from .output_lock import claimed
from .tracing import JobTrace, check_trace_path
from .runtime import resolve_checkpoint


class JobRun(ABC):
    """One job on every rank of ``comm``: ``run()`` takes the steps in order and returns the
    result on rank 0 (None on the other ranks). Subclasses hold their state on ``self``."""

    kind, verb = "working", "finish"    # what the job does, for messages ("scoring", "score")
    checking_phase: str | None = None   # the phase named while validating, if any
    output_is_folder = False

    def __init__(self, comm, job: Job):
        self.comm, self.job = comm, job
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ckpt: Checkpoint | None = None
        self.checked = None
        self.stop: StopRequest | None = None
        self.bar = None             # a progress display with close(), on rank 0

    # ---- the skeleton ----------------------------------------------------------------------

    def run(self):
        self.setup()
        if not self.has_work():
            return None
        tracing = JobTrace(self.comm, self.job.output.trace) if self.job.output.trace else None
        try:
            with claimed(self.comm, self.output_path(), folder=self.output_is_folder):
                with StopRequest() as self.stop:
                    if tracing:
                        tracing.start()
                    self.open()
                    self.work()
                    result = self.finish()
                    if tracing:
                        tracing.write(self.trace_metadata())
                    return result
        except Stopped as e:          # the output's lock and temporary file are gone by now
            self.close_bar(final=False)
            self.stopped_midway(e)
        finally:                      # a job that failed: no closing progress line, no trace
            self.close_bar(final=False)
            if tracing:
                tracing.abandon()
            self.release()

    def release(self) -> None:
        """Drop what the run made (model, caches, programs, streams) as the call returns.
        Its programs and streams call back into the run, so without this the device memory
        would wait for Python's cycle collector: a second run in the process held two
        models."""
        for name in [n for n in vars(self) if n not in ("comm", "job", "rank", "size")]:
            delattr(self, name)

    def setup(self) -> None:
        """The checkpoint opened and the job validated by every rank (an error on one is
        an error on all), then the job's timeout for every wait."""
        path = resolve_checkpoint(self.comm, self.job.model.checkpoint)
        everyone(self.comm, check_ops, self.job.parallel.backend)
        self.ckpt = everyone(self.comm, open_checkpoint, path)
        if self.checking_phase is None:
            self.checked = everyone(self.comm, self.validate)
        else:
            with phase(self.checking_phase):
                self.checked = everyone(self.comm, self.validate)
        if self.job.output.trace is not None:       # rank 0 writes it: its file system
            everyone(self.comm, lambda: self.rank != 0 or check_trace_path(
                self.job.output.trace, self.output_path(), self.output_is_folder))
        set_timeout(self.job.parallel.timeout)

    # ---- the steps a job kind writes -------------------------------------------------------

    @abstractmethod
    def validate(self):
        """The job as checked from ``self.job`` and ``self.ckpt`` (kept as ``self.checked``),
        or an ``HpcparError`` saying what is wrong (run on every rank; the ranks agree)."""

    def has_work(self) -> bool:
        return True

    def output_path(self) -> str | Path | None:
        return self.job.output.path or None

    @abstractmethod
    def open(self) -> None:
        """This rank's runtime and weights (collective)."""

    @abstractmethod
    def work(self) -> None:
        """The job's loop; a stop it acts on ends in ``preempted``."""

    @abstractmethod
    def finish(self):
        """Collect, report and write; free the runtime. The result on rank 0, else None."""

    # ---- shared pieces ---------------------------------------------------------------------

    def trace_metadata(self) -> dict:
        """What a ``--trace`` file says of the run besides its spans."""
        return {"job": self.verb, "layout": self.checked.layout.describe(), "checkpoint":
                str(self.ckpt.path)}

    def preempted(self, message: str) -> None:
        """Leave after a stop the job acted on: what was finished is saved, ``message``
        (rank 0) says so, and every rank exits with ``EXIT_PREEMPTED``."""
        self.close_bar()
        if self.rank == 0:
            print(message, flush=True)
        raise JobFailed(EXIT_PREEMPTED)

    def stopped_midway(self, e: Stopped) -> None:
        """A stop raised in a wait (a job that lets waits stop, ``board.stops_waits``):
        nothing was written; every rank waits for the others before it leaves."""
        if self.rank == 0:
            print(f"hpcpar: stopped on request ({e}) while {self.kind}: nothing was written; "
                  f"run it again to {self.verb}", file=sys.stderr, flush=True)
        _leave_together(self.comm)
        raise JobFailed(EXIT_PREEMPTED) from None

    def close_bar(self, final: bool = True) -> None:
        """End the progress display (``final``: with its closing line; once)."""
        if self.bar:
            self.bar.close(final)

    def run_attrs(self, backend: str, comm_kind: str) -> dict:
        """What every output records about its run (a job kind adds its own)."""
        layout = self.checked.layout
        return {"hpcpar_version": __version__, "checkpoint": str(self.ckpt.path),
                "dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "ep": layout.ep,
                "micro_batches": layout.micro_batches,
                "compute_dtype": dtype_name(self.checked.dtype), "backend": backend,
                "tp_comm": comm_kind}


def _leave_together(comm, seconds: float = 10.0) -> None:
    """Every stopped rank waits for the others before it exits: the launcher kills what
    is left of a job once one rank has ended with a failing status, which would cut a
    rank's own clean-up short. Ranks that never heard of the stop (another node's) are
    not waited for past ``seconds``."""
    alarm = waits.current_alarm()
    waits.listen_for_alarm(None)                # the stop it would raise is known
    try:
        waits.wait_bounded(comm.Ibarrier(), seconds, "leaving after the stop")
        _drop_messages_in_flight(comm)
    except CommTimeout:
        pass
    finally:
        waits.listen_for_alarm(alarm)


def _drop_messages_in_flight(comm) -> None:
    """Receive and drop what the other ranks sent this one before they stopped (a replica's
    results or heartbeat, rank 0's pings), all of it here once they have passed the barrier:
    MPI_Finalize fails on a message left unmatched, and mpiexec then takes the rank for
    crashed and kills the others, which showed as status 9 (1 stopped run in 12)."""
    from mpi4py import MPI
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        comm.Recv([np.empty(status.Get_count(MPI.BYTE), np.uint8), MPI.BYTE],
                  status.Get_source(), status.Get_tag())
