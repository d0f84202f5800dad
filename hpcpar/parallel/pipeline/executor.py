"""Runs one stage's action list: framed non-blocking messages, receives posted ahead.

Every message between stages is one contiguous byte buffer: a fixed 40-byte header (op,
micro-batch, step, chunk, flags as int64) followed by the payload. Where both ends know the
payload's shape (the jobs: every rank of a pipeline holds the same prompts), that is the
whole message. Where the program cannot say (``payload`` returns None: user stage functions,
micro-batches of any shape), the message describes itself: a fixed header that adds the
dtype and shape, then the payload as a second message. Either way the header lets the
receiver check that it got the message it expected, and carries the STOP flag that retires
a micro-batch whose rows have all finished.

Overlap: before a forward or backward pass, the receive the stage will need next is posted,
so its data arrives while this micro-batch computes; sends never block the compute. Only
when a channel has more unfinished sends than micro-batches in flight does the oldest get
waited on: at most one message per micro-batch can be unreceived on a channel, so that one
has arrived.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Protocol

import numpy as np

from ..device import budget
from .. import trace
from ..device.backend import DeviceClock
from ..comm import Communicator, Request
from ..device.dtypes import bfloat16
from ..errors import CommError, HpcparError
from .schedule import (COMPUTE, ENCODED_FIELDS, OP_CODES, RECVS, SENDS, Action, Op, decode, encode,
                       simulate)

HEADER_WORDS = 5                    # op, micro-batch, step, chunk, flags
HEADER_BYTES = HEADER_WORDS * 8
FLAG_STOP = 1
MAX_DIMS = 8                        # a described payload: dtype code, ndim, up to 8 dims
DESCRIBED_WORDS = HEADER_WORDS + 2 + MAX_DIMS
WIRE_DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.float16, bfloat16,
                                          np.int64, np.int32, np.int16, np.int8, np.uint8,
                                          np.bool_, np.uint16, np.uint32, np.uint64))


class StageProgram(Protocol):
    """What a stage computes; the executor decides when, and moves the messages."""

    def payload(self, a: Action) -> tuple[tuple[int, ...], np.dtype] | None:
        """Shape and dtype of the payload of a send or receive; None: the message describes
        itself (the same answer on both ends)."""

    def finished(self, mb: int) -> bool:
        """Whether micro-batch ``mb`` needs no more steps (checked before each FORWARD)."""

    def receive(self, a: Action, payload) -> None: ...

    def compute(self, a: Action) -> None:
        """Run a FORWARD, BACKWARD, BACKWARD_INPUT or BACKWARD_WEIGHT action."""

    def outgoing(self, a: Action):
        """The payload to send (an array of the ``payload`` shape)."""

    # optional: ``phase(a) -> 0 | 1``, whether an action's time counts as prefill (0) or
    # decode (1); without it, step 0 is the prefill


class Frame:
    """A header + payload byte buffer, with typed views of both."""

    def __init__(self, xp, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.buf = xp.empty(HEADER_BYTES + nbytes, dtype=xp.uint8)
        self.header = self.buf[:HEADER_BYTES].view(xp.int64)
        self.payload = self.buf[HEADER_BYTES:].view(dtype).reshape(shape)


def describe(header, payload) -> None:
    """Write ``payload``'s dtype and shape into a described header (host int64 words)."""
    dtype = np.dtype(payload.dtype)
    if dtype not in WIRE_DTYPES or payload.ndim > MAX_DIMS:
        raise HpcparError(f"pipeline message of dtype {dtype} and {payload.ndim} dimensions: "
                          f"send one of {', '.join(map(str, WIRE_DTYPES))}, at most "
                          f"{MAX_DIMS} dimensions")
    header[HEADER_WORDS] = WIRE_DTYPES.index(dtype)
    header[HEADER_WORDS + 1] = payload.ndim
    header[HEADER_WORDS + 2:HEADER_WORDS + 2 + payload.ndim] = payload.shape


def described(header) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a described header announces."""
    ndim = int(header[HEADER_WORDS + 1])
    shape = tuple(int(v) for v in header[HEADER_WORDS + 2:HEADER_WORDS + 2 + ndim])
    return shape, WIRE_DTYPES[int(header[HEADER_WORDS])]


@dataclass
class StageTimes:
    """Where one stage's time went, split by prefill (step 0) and decode (steps > 0)."""

    compute: list[float] = field(default_factory=lambda: [0.0, 0.0])
    wait: list[float] = field(default_factory=lambda: [0.0, 0.0])


class PipelineExecutor:
    def __init__(self, pp: Communicator, stage: int, program: StageProgram, backend,
                 in_flight: int, board=None):
        self.pp, self.stage, self.program = pp, stage, program
        self.board = board            # watchdog.ActionBoard: where this rank is, for reports
        self.backend, self.xp = backend, backend.xp
        self.in_flight = max(1, in_flight)
        self.times = StageTimes()
        self.clock = DeviceClock(backend)   # compute: device time (CUDA events on a GPU)
        self.step: int | None = None        # the training step running, for a trace

    # ---- pre-flight ------------------------------------------------------------------------

    def sized(self, actions: list[Action]) -> list[Action]:
        """``actions`` with every message's payload size filled in from the program."""
        out = []
        for a in actions:
            if a.op in SENDS or a.op in RECVS:
                known = self.program.payload(a)
                if known is not None:           # a described message's size is its own
                    shape, dtype = known
                    a = replace(a, nbytes=int(np.prod(shape, dtype=np.int64))
                                * np.dtype(dtype).itemsize)
            out.append(a)
        return out

    def preflight(self, actions: list[Action]) -> None:
        """Collective over the pipeline group: gather every stage's actions and check that each
        send meets its receive (same micro-batch, step and size) and nothing deadlocks.
        Raises ``HpcparError`` on every rank of the group alike."""
        mine = np.array(encode(self.sized(actions)), dtype=np.int64).reshape(-1, ENCODED_FIELDS)
        host = self.pp.on_host()               # host metadata: no trip through the device
        counts = host.all_gather(np.array([len(mine)], dtype=np.int64))
        rows = host.all_gather(mine, axis=0, sizes=[int(c) for c in counts])
        schedule, start = [], 0
        for c in counts:
            schedule.append(decode(rows[start:start + int(c)]))
            start += int(c)
        _, problems = simulate(schedule)
        if problems:
            raise HpcparError("pipeline schedule check failed before the first step: "
                              + "; ".join(problems[:3]))

    # ---- running ---------------------------------------------------------------------------

    def run(self, actions: list[Action], step: int | None = None) -> None:
        """Run the actions in order. Compute is device time (``DeviceClock``). Waiting is host
        time spent in receives and sends on the CPU; on a GPU, where the host blocks on queued
        compute too, it is the run's wall time, by phase, less its device compute time.
        ``step``: the training step the actions make, for a trace (generation's actions
        carry their own decode steps)."""
        before = list(self.times.compute), list(self.times.wait)
        wall = [0.0, 0.0]
        self.step = step
        self._run(actions, wall)
        if self.backend.is_gpu:
            for p in (0, 1):
                computed = self.times.compute[p] - before[0][p]
                self.times.wait[p] = before[1][p] + max(0.0, wall[p] - computed)

    def _run(self, actions: list[Action], wall: list[float]) -> None:
        xp, program = self.xp, self.program
        posted: dict[int, tuple[Frame, object]] = {}
        sends: dict[tuple, deque] = {}
        stop_step: dict[int, int] = {}            # micro-batch -> step its STOP applies from
        next_recv = _next_receive_indices(actions)
        mark, last_phase = perf_counter(), 0
        phase_of = getattr(program, "phase", lambda a: 0 if a.step == 0 else 1)

        def live(a: Action) -> bool:
            return a.mb not in stop_step or a.step == stop_step[a.mb] and a.op is Op.SEND

        def post(i: int):
            a = actions[i]
            known = program.payload(a)
            frame = Frame(xp, *known) if known is not None else _HeaderFrame(xp)
            posted[i] = (frame, self.pp.irecv(frame.buf, a.peer, tag=OP_CODES[a.op]))

        for i, a in enumerate(actions):
            if not live(a):
                continue
            if self.board is not None:
                self.board.publish(a, self.step)
            phase = phase_of(a)
            t0 = perf_counter()
            wall[last_phase] += t0 - mark
            mark, last_phase = t0, phase
            if a.op in RECVS:
                if i not in posted:
                    post(i)
                flags, payload = self._receive(a, *posted.pop(i))
                self.times.wait[phase] += perf_counter() - t0
                if flags & FLAG_STOP:
                    stop_step[a.mb] = a.step
                else:
                    program.receive(a, payload)
            elif a.op in COMPUTE:
                if a.op is Op.FORWARD and program.finished(a.mb):
                    stop_step[a.mb] = a.step
                    continue
                j = next_recv[i]
                while j is not None and not live(actions[j]):
                    j = next_recv[j]
                if j is not None and j not in posted:
                    post(j)
                started, tracer = self.clock.now(), trace.current()
                begin = perf_counter() if tracer is not None else 0.0
                if budget._current is None:
                    program.compute(a)
                else:                     # a device budget counts: by the action's phase
                    with budget.phase(budget_phase(program, a)):
                        program.compute(a)
                self.clock.add(self.times.compute, phase, started)
                if tracer is not None:
                    tracer.add(f"{a.op.name.lower()} {a.mb}", "compute", begin, perf_counter(),
                               {"micro-batch": a.mb, "chunk": a.chunk,
                                "step": a.step if self.step is None else self.step})
            else:  # a send
                queue = sends.setdefault((a.op, a.peer), deque())
                queue.append(self._send(a, a.mb in stop_step))
                while len(queue) > self.in_flight:
                    queue.popleft().wait()
                self.times.wait[phase] += perf_counter() - t0
        t0 = perf_counter()
        for queue in sends.values():
            while queue:
                queue.popleft().wait()
        self.clock.settle()
        end = perf_counter()
        self.times.wait[1] += end - t0
        wall[last_phase] += end - mark

    def _receive(self, a: Action, frame: Frame, request) -> tuple[int, object]:
        """The flags and payload of ``a``'s message, once its posted receive completes (a
        described payload, whose shape came in the header, is received after it)."""
        request.wait()
        header = self.backend.to_host(frame.header)
        op, mb, step, chunk, flags = (int(v) for v in header[:HEADER_WORDS])
        if (op, mb, step, chunk) != (OP_CODES[_sender_of(a.op)], a.mb, a.step, a.chunk):
            raise CommError(f"pipeline stage {self.stage} expected {a} but received "
                            f"op {op}, micro-batch {mb}, step {step}, chunk {chunk}")
        payload = frame.payload
        if payload is None and not flags & FLAG_STOP:            # described: now its payload
            shape, dtype = described(header)
            payload = self.xp.empty(shape, dtype=dtype)
            self.pp.irecv(payload, a.peer, tag=OP_CODES[a.op]).wait()
        return flags, payload

    def _send(self, a: Action, stop: bool):
        """Start sending ``a``'s message (a STOP header alone when ``stop``); the request."""
        xp, tag = self.xp, OP_CODES[_receiver_of(a.op)]
        known = self.program.payload(a)
        head = [OP_CODES[a.op], a.mb, a.step, a.chunk, FLAG_STOP if stop else 0]
        if known is not None:
            frame = Frame(xp, *known)
            if not stop:
                frame.payload[...] = self.program.outgoing(a)
            frame.header[...] = xp.asarray(head, dtype=xp.int64)
            return self.pp.isend(frame.buf, a.peer, tag=tag)
        header = np.zeros(DESCRIBED_WORDS, dtype=np.int64)
        header[:HEADER_WORDS] = head
        payload = None
        if not stop:
            payload = xp.ascontiguousarray(self.program.outgoing(a))
            describe(header, payload)
        frame = _HeaderFrame(xp)
        frame.header[...] = xp.asarray(header)
        first = self.pp.isend(frame.buf, a.peer, tag=tag)
        if payload is None:
            return first
        second = self.pp.isend(payload, a.peer, tag=tag)
        return Request(lambda: (first.wait(), second.wait()), keepalive=(first, second))


def budget_phase(program, a: Action) -> str:
    """The device budget's phase of a compute action: the program's ``budget_phase(a)``
    (generation: prefill or decode), else the operation (forward, backward, ...)."""
    named = getattr(program, "budget_phase", None)
    return named(a) if named is not None else a.op.name.lower()


class _HeaderFrame:
    """A described message's header alone (its payload follows as a second message)."""

    def __init__(self, xp):
        self.buf = xp.zeros(DESCRIBED_WORDS * 8, dtype=xp.uint8)
        self.header = self.buf.view(xp.int64)
        self.payload = None


_SENDER_OF = {Op.RECV: Op.SEND, Op.RECV_LOOP: Op.SEND_LOOP, Op.RECV_GRAD: Op.SEND_GRAD}
_RECEIVER_OF = {send: recv for recv, send in _SENDER_OF.items()}


def _sender_of(op: Op) -> Op:
    return _SENDER_OF[op]


def _receiver_of(op: Op) -> Op:
    return _RECEIVER_OF[op]


def _next_receive_indices(actions: list[Action]) -> list[int | None]:
    """For each position, the index of the first receive after it (None if none)."""
    out: list[int | None] = [None] * len(actions)
    nxt = None
    for i in range(len(actions) - 1, -1, -1):
        out[i] = nxt
        if actions[i].op in RECVS:
            nxt = i
    return out
