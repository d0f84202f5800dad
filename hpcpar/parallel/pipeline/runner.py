"""A pipeline over user stage functions: GPipe, 1F1B, interleaved 1F1B and ZB-H1.

Every rank of a pipeline group holds one stage (or V chunks of the model, interleaved) as an
object with

    forward(x) -> (y, ctx)                  y: an array (sent to the next stage)
    backward(dy, ctx) -> dx                 adds its weight gradients itself
    backward_input(dy, ctx) -> (dx, wctx)   optional, for ZB-H1: the input gradient first,
    backward_weight(wctx) -> None           and the weight gradients later, in a bubble

(``Stage(forward, backward)`` makes one from functions). The last stage turns its output into
a micro-batch's loss with ``loss(y, target) -> (value, dy)``. One ``train_step`` runs the
schedule's actions with the same executor as the hpcpar jobs: receives posted ahead, sends
that never block the compute, every wait bounded by the group's timeout. Messages carry
their own dtype and shape, so micro-batches of different shapes need no declaration.

Before the first step of a given micro-batch count, every rank's action list is gathered and
simulated (the pre-flight check): a schedule that would deadlock or mismatch is one error on
every rank. A stage function that raises, or returns the wrong thing, is reported by its
rank, and every other rank of the group stops waiting at once with an error naming it
(``PeerFailed``), instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..tensor import splits
from ..device import waits
from ..comm import Communicator
from ..comm.failfast import MESSAGE_BYTES, failure_message, failure_of, fails_together
from ..errors import HpcparError, PeerFailed
from ..params import join, named_parameters
from .executor import PipelineExecutor
from .schedule import Action, Op, gpipe_forward
from .training_schedules import bubble_formula, micro_batch_problems, training_schedule


@dataclass
class Stage:
    """A stage from plain functions (``backward_input``/``backward_weight`` optional).
    Functions hold no parameters ``named_parameters`` can find (closures are not searched):
    ``params`` names the ones they use, a list, a dict by name or any object that holds
    them, listed by ``Pipeline.named_parameters`` (``stage0.0``, ``stage0.w``, ...)."""

    forward: Callable
    backward: Callable
    backward_input: Callable | None = None
    backward_weight: Callable | None = None
    params: object = None

    def named_parameters(self, prefix: str = "") -> dict:
        """``params``' parameters, by position in a list, by key in a dict, by attribute
        path in an object."""
        return {} if self.params is None else named_parameters(self.params, prefix)


def split_micro_batches(x, num: int, axis: int = 0) -> list:
    """``x`` cut into ``num`` micro-batches along ``axis`` (``numpy.array_split``'s rule)."""
    if not 1 <= num <= x.shape[axis]:
        raise HpcparError(f"cannot cut {x.shape[axis]} rows into {num} micro-batches")
    return splits.split(x, axis, num, splits.even_sizes(x.shape[axis], num))


def concat_micro_batches(parts: Sequence, xp=np, axis: int = 0):
    """The micro-batches joined back along ``axis``."""
    return xp.concatenate(list(parts), axis=axis)


class Pipeline:
    """One stage's part of a pipeline over the communicator ``group`` (its rank is the stage).

    ``stages``: this rank's stage, or a list of V chunks (chunk c is virtual stage
    c * p + rank: ``schedule="interleaved"``). ``loss(y, target) -> (value, dy)`` runs on the
    last virtual stage. ``recompute``: keep only each forward's input and recompute the
    forward in the backward (memory for time).
    """

    def __init__(self, group: Communicator, stages, loss: Callable | None = None,
                 schedule: str = "1f1b", recompute: bool = False):
        self.group = group
        self.error_board = group.error_board     # its mesh's (comm.failfast.fails_together)
        self.chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        self.p, self.rank, self.V = group.size, group.rank, len(self.chunks)
        self.loss, self.schedule, self.recompute = loss, schedule, recompute
        # the counts themselves are checked per step; here the schedule and V (p
        # micro-batches always fit), in the library's words (the flags are the jobs'), and
        # the stages: one error on every rank of the group, agreed before the first
        # collective (the error channel's)
        error = None
        if (schedule == "interleaved") != (self.V > 1):
            error = HpcparError(
                "pipeline: the interleaved schedule takes a list of at least 2 chunks per "
                f"stage (stages=[chunk_0, chunk_1, ...]), and only it does; got {self.V} "
                f"chunk(s) with schedule {schedule!r}")
        elif problems := micro_batch_problems(schedule, self.p, self.p, self.V):
            error = HpcparError("pipeline: " + "; ".join(problems))
        for c in self.chunks:
            if error is None and not (callable(getattr(c, "forward", None))
                                      and callable(getattr(c, "backward", None))):
                error = HpcparError(f"pipeline: a stage of type {type(c).__name__} needs "
                                    f"forward(x) -> (y, ctx) and backward(dy, ctx) -> dx "
                                    f"(hpcpar.parallel.Stage)")
        group.agree("Pipeline", [("schedule", schedule), ("chunks per stage", self.V)], error)
        self._checked: set[tuple] = set()
        self._errors = _ErrorChannel(group)
        self.times = None           # the last step's compute and wait times (bubble())

    def world_ranks(self) -> tuple[int, ...]:
        """The ranks that run this pipeline's steps together (its group's)."""
        return self.group.world_ranks()

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the model's last (virtual) stage, where the loss is."""
        return self.rank == self.p - 1

    # ---- steps ----------------------------------------------------------------------------

    @fails_together
    def train_step(self, inputs: Sequence, targets: Sequence) -> list[float]:
        """Forward and backward of every micro-batch under the schedule. ``inputs`` (read on
        the first stage) and ``targets`` (read on the last) are lists of one entry per
        micro-batch, the same count on every rank (entries a rank does not read may be None).
        Returns the micro-batches' losses on the last stage, [] elsewhere. Gradients are
        left in the stages' parameters (summed over micro-batches)."""
        m = len(inputs)
        error = None
        if len(targets) != m:
            error = HpcparError(f"pipeline: {m} input micro-batches but {len(targets)} targets")
        elif self.loss is None:
            error = HpcparError("pipeline: train_step needs loss(y, target) -> (value, dy)")
        elif problems := micro_batch_problems(self.schedule, self.p, m, self.V):
            error = HpcparError("pipeline: " + "; ".join(problems))
        self._agree("Pipeline.train_step", m, error)
        actions = training_schedule(self.schedule, self.p, m, self.V)[self.rank]
        program = _UserProgram(self, inputs, targets)
        self._run(program, actions, ("train", m))
        return [program.losses[i] for i in range(m)] if self.is_last else []

    @fails_together
    def forward(self, inputs: Sequence) -> list:
        """The last stage's outputs of every micro-batch (GPipe forward; [] on other ranks)."""
        m = len(inputs)
        self._agree("Pipeline.forward", m, HpcparError("pipeline: forward runs one chunk per "
                                                      "stage") if self.V != 1 else None)
        actions = gpipe_forward(self.p, m)[self.rank]
        program = _UserProgram(self, inputs, [None] * m, keep_outputs=True)
        self._run(program, actions, ("forward", m))
        return [program.results[i] for i in range(m)] if self.is_last else []

    def _agree(self, what: str, m: int, error: HpcparError | None) -> None:
        """Every stage runs the same number of micro-batches under the same schedule (one
        check over the group; a rank's own error stops them all)."""
        self.group.agree(what, [("micro-batch count (the length of inputs)", m),
                                ("schedule", self.schedule), ("chunks per stage", self.V)],
                         error)

    def named_parameters(self, prefix: str = "") -> dict:
        """This rank's stage parameters, under ``stage{v}.`` for virtual stage v (the
        model's position of each chunk), so names are unique over the pipeline."""
        out: dict = {}
        for c, chunk in enumerate(self.chunks):
            virtual = c * self.p + self.rank
            out |= named_parameters(chunk, join(prefix, f"stage{virtual}"))
        return out

    def parameters(self) -> list:
        return list(self.named_parameters().values())

    def _run(self, program, actions: list[Action], key: tuple) -> None:
        executor = PipelineExecutor(self.group, self.rank, program, self.group.backend,
                                    in_flight=max(1, len(program.inputs)))
        previous = waits.current_alarm()
        waits.listen_for_alarm(lambda: self._errors.alarm() or (previous() if previous
                                                                else None))
        if key not in self._checked:       # collective, and every rank fails alike
            executor.preflight(actions)
            self._checked.add(key)
        self._errors.listen()
        try:
            executor.run(actions)
        except PeerFailed:
            raise
        except Exception as e:
            self._errors.announce(e)
            raise
        finally:
            waits.listen_for_alarm(previous)
            self._errors.stop()
        self.times = executor.times     # not the executor: it holds the step's activations

    # ---- figures ---------------------------------------------------------------------------

    def bubble(self) -> float:
        """The measured idle share of this stage in the last step: waiting / (compute +
        waiting)."""
        if self.times is None:
            return 0.0
        t = self.times
        busy, idle = sum(t.compute), sum(t.wait)
        return idle / (busy + idle) if busy + idle else 0.0

    def bubble_formula(self, micro_batches: int) -> float:
        """The schedule's idle share with unit costs (F 1, B 2)."""
        return bubble_formula(self.schedule, self.p, micro_batches, self.V)


class _UserProgram:
    """The executor's ``StageProgram`` over user stage functions."""

    def __init__(self, pipe: Pipeline, inputs, targets, keep_outputs: bool = False):
        self.pipe, self.inputs, self.targets = pipe, list(inputs), list(targets)
        self.keep_outputs = keep_outputs
        self.received: dict[tuple[int, int], object] = {}
        self.grads: dict[tuple[int, int], object] = {}
        self.outgoing_store: dict[tuple[Op, int, int], object] = {}
        self.ctxs: dict[tuple[int, int], object] = {}
        self.wctxs: dict[tuple[int, int], object] = {}
        self.losses: dict[int, float] = {}
        self.results: dict[int, object] = {}

    def _virtual(self, chunk: int) -> int:
        return chunk * self.pipe.p + self.pipe.rank

    def _last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.pipe.p * self.pipe.V - 1

    # ---- StageProgram ----------------------------------------------------------------------

    def payload(self, a: Action):
        return None                        # messages describe themselves

    def finished(self, mb: int) -> bool:
        return False

    def receive(self, a: Action, payload) -> None:
        store = self.received if a.op is Op.RECV else self.grads
        store[(a.mb, a.chunk)] = payload

    def outgoing(self, a: Action):
        return self.outgoing_store.pop((a.op, a.mb, a.chunk))

    def compute(self, a: Action) -> None:
        key, stage = (a.mb, a.chunk), self.pipe.chunks[a.chunk]
        if a.op is Op.FORWARD:
            x = self.inputs[a.mb] if self._virtual(a.chunk) == 0 else self.received.pop(key)
            y, ctx = _forward(stage, x, self._virtual(a.chunk))
            self.ctxs[key] = (x, None) if self.pipe.recompute else (x, ctx)
            if self._last(a.chunk):
                if self.keep_outputs:
                    self.results[a.mb] = y
                    return
                value, dy = _loss(self.pipe.loss, y, self.targets[a.mb])
                self.losses[a.mb] = value
                self.grads[key] = dy
            else:
                nxt = (self._virtual(a.chunk) + 1) // self.pipe.p
                self.outgoing_store[(Op.SEND, a.mb, nxt)] = y
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            x, ctx = self.ctxs.pop(key)
            if ctx is None:                           # recompute the forward
                _, ctx = _forward(stage, x, self._virtual(a.chunk))
            dy = self.grads.pop(key)
            if a.op is Op.BACKWARD_INPUT and getattr(stage, "backward_input", None):
                dx, self.wctxs[key] = stage.backward_input(dy, ctx)
            else:
                dx = stage.backward(dy, ctx)
            if self._virtual(a.chunk) > 0:
                if getattr(dx, "shape", None) != getattr(x, "shape", None):
                    raise HpcparError(
                        f"pipeline stage {self._virtual(a.chunk)}: backward returned dx of "
                        f"shape {getattr(dx, 'shape', type(dx).__name__)}; its input x had "
                        f"shape {tuple(x.shape)} (dx is the gradient of x)")
                prev = (self._virtual(a.chunk) - 1) // self.pipe.p
                self.outgoing_store[(Op.SEND_GRAD, a.mb, prev)] = dx
        elif a.op is Op.BACKWARD_WEIGHT:
            if key in self.wctxs:
                stage.backward_weight(self.wctxs.pop(key))


def _loss(loss, y, target):
    """(value as a float, dy) from the user's loss, or what it returned instead."""
    out = loss(y, target)
    if not (isinstance(out, tuple) and len(out) == 2
            and getattr(out[1], "shape", None) == y.shape):
        raise HpcparError(f"pipeline: loss(y, target) must return (value, dy) with dy the "
                          f"gradient of value, shaped like y {tuple(y.shape)}; it returned "
                          f"{_what(out)}")
    return float(out[0]), out[1]


def _what(out) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(str(getattr(o, "shape", type(o).__name__)) for o in out) + ")"
    return type(out).__name__


def _forward(stage, x, virtual: int):
    out = stage.forward(x)
    if not (isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape")
            and hasattr(out[0], "dtype")):
        raise HpcparError(f"pipeline stage {virtual}: forward must return a pair (y, ctx) "
                          f"with y an array; it returned {_what(out)}")
    return out


class _ErrorChannel:
    """A side channel on which a failing rank tells the others why, so that they stop
    waiting for it at once (bounded waits poll it as their alarm). Its receive is posted
    for the length of a step only, so nothing is left pending at exit."""

    TAG = 31_337

    def __init__(self, group: Communicator):
        from mpi4py import MPI
        self.comm = group.mpi_comm.Dup()            # collective: every rank of the group
        self.size = group.size
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.buf = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
        self.request = None

    def listen(self) -> None:
        from mpi4py import MPI
        if self.size > 1:
            self.request = self.comm.Irecv(self.buf, source=MPI.ANY_SOURCE, tag=self.TAG)

    def stop(self) -> None:
        if self.request is not None and not self.request.Test():
            self.request.Cancel()
            self.request.Wait()
        self.request = None

    def alarm(self):
        if self.request is None or not self.request.Test():
            return None
        self.request = None
        return failure_of(self.buf)

    def announce(self, error: Exception) -> None:
        """Tell every other rank of the group that this one failed, and why."""
        msg = failure_message(error, self.world_rank)
        # the message and its requests are kept alive until delivered
        self._msg = msg
        self._sends = [self.comm.Isend(msg, dest=r, tag=self.TAG)
                       for r in range(self.size) if r != self.comm.Get_rank()]
