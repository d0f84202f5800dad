"""What this rank did and when, as spans for a timeline: compute, waits on messages and
collectives, and the job's phases; written as the Chrome trace format that Perfetto
(ui.perfetto.dev) and chrome://tracing open, one track per rank (``gather``).

Off (the default), a traced call site costs one read of a module global. On (``start``), a
span is two clock reads and a tuple appended to a list, far below the microseconds of the
smallest collective; ``MAX_SPANS`` bounds a long run's memory (later spans are counted, not
kept). Spans are host time: on a GPU, where compute is queued on a stream, a compute span is
the time to queue it, and the device's time shows in the waits that follow.

Spans are taken on one thread, around calls that return before the next begins, so they nest:
a tensor-parallel all-reduce sits inside the forward pass that made it, and that inside the
job's phase. Library users trace their own code the same way (``span``), and a job's ranks
write one file together (``hpcpar.jobs.tracing``).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from time import perf_counter

import numpy as np

from .device import waits
from .errors import HpcparError

MAX_SPANS = 250_000        # per rank: ~30 MB of JSON
TAG_CLOCK = 31             # aligned_origin's ping-pong


class Tracer:
    """One rank's spans, in seconds since ``origin`` (a ``perf_counter`` reading the ranks
    agree on: ``aligned_origin``)."""

    def __init__(self, origin: float | None = None):
        self.origin = perf_counter() if origin is None else origin
        self.spans: list[tuple] = []     # (name, category, start, end, args or None)
        self.dropped = 0

    def add(self, name: str, category: str, start: float, end: float,
            args: dict | None = None) -> None:
        if len(self.spans) < MAX_SPANS:
            self.spans.append((name, category, start, end, args))
        else:
            self.dropped += 1

    def events(self, pid: int, track: str) -> list[dict]:
        """This rank's spans as Chrome trace events (complete events, ``"ph": "X"``, in
        microseconds) on process ``pid`` named ``track``."""
        out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": track}},
               {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}},
               {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0,
                "args": {"name": track}}]
        for name, category, start, end, args in self.spans:
            event = {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": 0,
                     "ts": round((start - self.origin) * 1e6, 3),
                     "dur": round((end - start) * 1e6, 3)}
            if args:
                event["args"] = args
            out.append(event)
        return out

    def encoded(self, pid: int, track: str) -> bytes:
        """``events`` as UTF-8 JSON (a list), for sending as bytes."""
        return json.dumps(self.events(pid, track), separators=(",", ":"),
                          default=_plain).encode()


_state: dict = {"tracer": None}


def current() -> Tracer | None:
    """The tracer spans go to, or None (tracing off)."""
    return _state["tracer"]


def start(origin: float | None = None) -> Tracer:
    """Trace this rank from now on (see ``Tracer``); returns the tracer."""
    if _state["tracer"] is not None:
        raise HpcparError("trace.start(): this rank is tracing already; trace.stop() first "
                          "(it returns the spans so far)")
    _state["tracer"] = Tracer(origin)
    return _state["tracer"]


def stop() -> Tracer | None:
    """Stop tracing; returns what was traced (None if it was off)."""
    tracer, _state["tracer"] = _state["tracer"], None
    return tracer


@contextmanager
def span(name: str, category: str = "phase", **args):
    """Trace the block as one span (nothing when tracing is off)."""
    tracer = _state["tracer"]
    if tracer is None:
        yield
        return
    begin = perf_counter()
    try:
        yield
    finally:
        tracer.add(name, category, begin, perf_counter(), args or None)


def aligned_origin(comm, rounds: int = 8) -> float:
    """Collective over the mpi4py communicator ``comm``: this rank's ``perf_counter`` reading
    at the moment rank 0's read its own origin, so that every rank's spans share one time
    axis. Each rank's clock is set against rank 0's by ping-pong (the exchange with the
    shortest round trip, its reading taken at the midpoint, as NTP does): a barrier alone
    leaves ranks that the scheduler held back after it milliseconds late, and nodes' clocks
    differ by their boot times."""
    rank, size = comm.Get_rank(), comm.Get_size()
    reading = np.zeros(1)

    def wait(request, what: str) -> None:
        _wait(request, f"setting the trace's clock: {what}")

    if rank == 0:
        origin = perf_counter()
        for peer in range(1, size):
            for _ in range(rounds):
                wait(comm.Irecv(reading, source=peer, tag=TAG_CLOCK), f"rank {peer}'s ping")
                reading[0] = perf_counter()
                wait(comm.Isend(reading, dest=peer, tag=TAG_CLOCK), f"the reply to {peer}")
        reading[0] = origin
        wait(comm.Ibcast(reading, root=0), "rank 0's origin")
        return origin
    best, offset = float("inf"), 0.0
    for _ in range(rounds):
        sent = perf_counter()
        wait(comm.Isend(reading, dest=0, tag=TAG_CLOCK), "the ping to rank 0")
        wait(comm.Irecv(reading, source=0, tag=TAG_CLOCK), "rank 0's reply")
        back = perf_counter()
        if back - sent < best:             # rank 0's clock read reading[0] at about the middle
            best, offset = back - sent, reading[0] - (sent + back) / 2
    wait(comm.Ibcast(reading, root=0), "rank 0's origin")      # on rank 0's clock
    return float(reading[0]) - offset


def gather(comm, tracer: Tracer, track: str, metadata: dict,
           root: int = 0) -> tuple[bytes, dict] | None:
    """Collective over the mpi4py communicator ``comm``: every rank's spans (its ``track``
    named as given) as one Chrome trace file on ``root``: its bytes and its ``otherData``
    (``metadata``, root's, with the rank count and the spans dropped past ``MAX_SPANS``);
    None elsewhere. The parts travel as bytes through ``Gatherv``, never pickled."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    problem, part = None, np.empty(0, np.uint8)
    if not isinstance(tracer, Tracer):
        problem = (f"trace.gather: got {type(tracer).__name__} for the tracer; pass what "
                   "trace.stop() returned after trace.start()")
    elif rank == root and not isinstance(metadata, dict):
        problem = f"trace.gather: metadata must be a dict, got {type(metadata).__name__}"
    else:
        try:
            part = np.frombuffer(tracer.encoded(rank, track), dtype=np.uint8)
        except (TypeError, ValueError, RecursionError) as e:    # a span's args JSON refuses
            problem = f"trace.gather: this rank's spans cannot be written as JSON: {e}"
    failed = np.array([rank if problem else size], np.int64)    # agreed, so no rank waits
    _wait(comm.Iallreduce(MPI.IN_PLACE, failed, op=MPI.MIN), "checking the trace's parts")
    if failed[0] < size:
        raise HpcparError(problem or f"trace.gather: rank {int(failed[0])} could not send its "
                                     "part (its error says why)")
    counts = np.zeros(size, np.int64)
    _wait(comm.Igather(np.array([len(part)], np.int64), counts if rank == root else None,
                       root=root), "gathering the trace's sizes")
    dropped = np.zeros(1, np.int64)
    _wait(comm.Ireduce(np.array([tracer.dropped], np.int64), dropped, root=root),
          "counting the spans dropped")
    gathered = np.empty(int(counts.sum()), np.uint8)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    _wait(comm.Igatherv(part, [gathered, counts, starts, MPI.BYTE] if rank == root else None,
                        root=root), "gathering the trace")
    if rank != root:
        return None
    parts = [gathered[a:a + n].tobytes() for a, n in zip(starts, counts)]
    info = dict(metadata, ranks=len(parts), dropped_spans=int(dropped[0]))
    return chrome_trace(parts, info), info


def chrome_trace(parts: list[bytes], metadata: dict) -> bytes:
    """The trace file from every rank's ``encoded`` events: a JSON object Perfetto and
    chrome://tracing open (``traceEvents``, ``displayTimeUnit``, and ``otherData``)."""
    body = b",".join(part.strip()[1:-1] for part in parts if part.strip() not in (b"", b"[]"))
    head = json.dumps({"displayTimeUnit": "ms", "otherData": metadata},
                      default=_plain)[:-1].encode()
    return head + b',"traceEvents":[' + body + b"]}\n"


def _wait(request, what: str) -> None:
    """An MPI request, waited for within ``--timeout`` (``waits``), as every wait is."""
    waits.wait_bounded(request, waits.limit(), what)


def _plain(value):
    """What JSON cannot write as it is, as JSON data: NumPy numbers and arrays as numbers and
    lists, anything else as its text."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return str(value)
