"""What one pipeline stage computes in a training step (the executor's ``StageProgram``).

The stage holds one model chunk per virtual stage it runs (one, or V when interleaved).
Forward passes keep their ctx until the backward of the same (micro-batch, chunk); the last
chunk of the model turns its forward into the micro-batch's share of the loss, and its
backward starts from that loss. A zero-bubble schedule's I pass computes the input
gradient and leaves the weight gradients in a deferred ``GradSink`` that its W pass flushes.

When the last backward of a chunk adds a group of gradients, ``grad_done`` hears of it, so
the data-parallel reduction of that bucket can start while the backward goes on.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...parallel.pipeline.schedule import Action, Op
from .model_chunk import Batch, ModelChunk, held_bytes
from .params import GradSink, Param, Parameter


class TrainSink(GradSink):
    """A ``GradSink`` that passes over weights without a gradient (a LoRA run's frozen
    base: norms, embedding, head, experts); what would compute theirs is never called.
    ``hooks`` (ZeRO 2 and 3) open a weight's gradient buffer just before it is added to;
    the first gradient of a micro-batch is written into it, not added to zeros."""

    def __init__(self, xp, defer: bool = False, hooks=None):
        super().__init__(xp, defer)
        self.hooks = hooks

    def add(self, param, grad) -> None:
        if not isinstance(param, Parameter):
            return
        if self.defer:
            self.pending.append((param, grad))
        elif self.hooks is not None and self.hooks.adding(param):
            param.grad[...] = grad()
        else:
            param.grad += grad()

    def scatter_rows(self, param, rows, values) -> None:
        if not isinstance(param, Parameter):
            return
        if self.hooks is None:
            super().scatter_rows(param, rows, values)
            return
        if self.defer:
            self.pending.append((None, lambda: self._add_rows(param, rows, values)))
        else:
            self._add_rows(param, rows, values)

    def _add_rows(self, param, rows, values) -> None:
        if self.hooks.adding(param):
            param.grad[...] = 0
        GradSink(self.xp).scatter_rows(param, rows, values)

    def flush(self) -> None:
        defer, self.defer = self.defer, False
        for param, grad in self.pending:
            if param is None:
                grad()                   # an in-place update (scatter_rows)
            else:
                self.add(param, grad)
        self.pending.clear()
        self.defer = defer


class TrainingProgram:
    def __init__(self, chunks: list[ModelChunk], batches: list[Batch], pp_size: int,
                 stage: int, hidden_size: int, dtype, xp,
                 grad_done: Callable[[list[Param]], None] | None = None, hooks=None):
        """``hooks``: ZeRO 2 and 3's (``sharded_units.ZeroHooks``), told of every gradient
        added and of every group complete in each micro-batch."""
        self.chunks, self.batches = chunks, batches
        self.hooks = hooks
        self.p, self.stage, self.hidden, self.dtype, self.xp = (pp_size, stage, hidden_size,
                                                                np.dtype(dtype), xp)
        self.grad_done = grad_done
        self.loss = 0.0                       # this stage's sum of micro-batch losses
        self.ctxs: dict[tuple[int, int], tuple] = {}   # (mb, chunk) -> ctx, its bytes, ...
        self.inputs: dict[tuple[int, int], object] = {}
        self.out_grads: dict[tuple[int, int], object] = {}
        self.outputs: dict[tuple[int, int], object] = {}
        self.back_grads: dict[tuple[int, int], object] = {}
        self.sinks: dict[tuple[int, int], GradSink] = {}
        self.backwards_done = [0] * len(chunks)   # weight-gradient passes finished per chunk
        self.held = self.peak_held = 0            # activation bytes kept for backward
        self.held_full = self.peak_held_full = 0  # ... had recompute been off

    def _virtual(self, chunk: int) -> int:
        return chunk * self.p + self.stage

    # ---- StageProgram ----------------------------------------------------------------------

    def payload(self, a: Action):
        B, T = self.batches[a.mb].shape
        split = self.chunks[a.chunk].stage.sequence_split      # tp under sequence parallelism
        return (B, T // split, self.hidden), self.dtype

    def finished(self, mb: int) -> bool:
        return False

    def receive(self, a: Action, payload) -> None:
        store = self.inputs if a.op is Op.RECV else self.out_grads
        store[(a.mb, a.chunk)] = payload

    def outgoing(self, a: Action):
        store = self.outputs if a.op is Op.SEND else self.back_grads
        return store.pop((a.mb, a.chunk))

    def compute(self, a: Action) -> None:
        key, chunk = (a.mb, a.chunk), self.chunks[a.chunk]
        if a.op is Op.FORWARD:
            out, ctx = chunk.forward(self.inputs.pop(key, None), self.batches[a.mb])
            nbytes = held_bytes(ctx)
            full = nbytes + chunk.recompute_saving(self.batches[a.mb])
            self.ctxs[key] = (ctx, nbytes, full)
            self.held += nbytes
            self.held_full += full
            self.peak_held = max(self.peak_held, self.held)
            self.peak_held_full = max(self.peak_held_full, self.held_full)
            if chunk.last:
                self.loss += float(out)
            else:
                self.outputs[(a.mb, (self._virtual(a.chunk) + 1) // self.p)] = out
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            ctx, nbytes, full = self.ctxs.pop(key)
            split = a.op is Op.BACKWARD_INPUT
            sink = TrainSink(self.xp, defer=split, hooks=self.hooks)
            last_pass = not split and self.backwards_done[a.chunk] == len(self.batches) - 1
            notify = self._notifier(chunk, last_pass)
            dx = chunk.backward(ctx, self.out_grads.pop(key, None), sink, notify)
            self.held -= nbytes
            self.held_full -= full
            if dx is not None:
                self.back_grads[(a.mb, (self._virtual(a.chunk) - 1) // self.p)] = dx
            if split:
                self.sinks[key] = sink
            else:
                self._weight_pass_done(a.chunk, None)
        elif a.op is Op.BACKWARD_WEIGHT:
            self.sinks.pop(key).flush()
            if self.hooks is not None:
                for group in chunk.groups:
                    self.hooks.done(group)
            self._weight_pass_done(a.chunk, chunk)
        else:
            raise ValueError(f"not a compute action: {a}")

    def _notifier(self, chunk: ModelChunk, last_pass: bool):
        """What hears that group k of ``chunk`` has its gradients: ZeRO's hooks every
        micro-batch, the overlapped reduction in the last."""
        hooks, grad_done = self.hooks, self.grad_done if last_pass else None
        if hooks is None and grad_done is None:
            return None

        def notify(k: int) -> None:
            if hooks is not None:
                hooks.done(chunk.groups[k])
            if grad_done is not None:
                grad_done(chunk.groups[k])
        return notify

    def _weight_pass_done(self, index: int, flushed: ModelChunk | None) -> None:
        """Count a finished weight-gradient pass; after a chunk's last W every group of it
        is complete at once (a B pass reported its groups as it went)."""
        self.backwards_done[index] += 1
        if (flushed is not None and self.grad_done is not None
                and self.backwards_done[index] == len(self.batches)):
            for group in flushed.groups:
                self.grad_done(group)
