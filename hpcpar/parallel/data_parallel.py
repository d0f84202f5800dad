"""Data parallelism over any model's parameters: gradients summed over replicas in buckets
while the backward runs, and the global gradient norm.

The gradients live in a few flat buffers (buckets), filled in the order the backward
completes them (for a layered model: the last layer first). As soon as every gradient of a
bucket is complete (``grads_done``), a non-blocking AllReduce of the whole bucket starts over
the data-parallel group, so the reduction overlaps the rest of the backward; ``finish``
starts what is left and waits, and says how long it had to wait (the part not hidden).
Sums, as DDP's are before its division: divide the loss by the global batch to average.
"""

from __future__ import annotations

import math
from time import perf_counter

import numpy as np

from ..comm import Communicator, Request
from .params import Parameter

BUCKET_BYTES = 25 << 20        # PyTorch DDP's default bucket size


class GradientReducer:
    """Buckets over ``groups`` (lists of params, in the order their gradients complete);
    every param's ``grad`` becomes a view into its bucket's flat buffer."""

    def __init__(self, dp: Communicator, groups: list[list[Parameter]], xp=None,
                 bucket_bytes: int = BUCKET_BYTES):
        self.dp, self.xp = dp, xp if xp is not None else dp.xp
        self.buckets: list = []                             # each bucket's flat buffer
        self.bucket_params: list[list[Parameter]] = []      # each bucket's params, in order
        self.bucket_of: dict[int, int] = {}
        current: list[Parameter] = []
        size = 0
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                current.append(p)
                size += p.grad.nbytes
            if size >= bucket_bytes:
                self._make_bucket(current)
                current, size = [], 0
        if current:
            self._make_bucket(current)
        self.pending: dict[int, set[int]] = {}
        self.requests: list[Request] = []
        self.exposed_seconds = 0.0          # waited for after the backward, over the run
        self.started_early = self.started = 0   # buckets launched during the backward / all

    def _make_bucket(self, params: list[Parameter]) -> None:
        dtype = params[0].grad.dtype
        flat = self.xp.zeros(sum(p.grad.size for p in params), dtype=dtype)
        offset = 0
        for p in params:
            view = flat[offset:offset + p.grad.size].reshape(p.grad.shape)
            view[...] = p.grad
            p.grad = view
            offset += p.grad.size
            self.bucket_of[id(p)] = len(self.buckets)
        self.buckets.append(flat)
        self.bucket_params.append(list(params))

    def start_step(self) -> None:
        self.pending = {b: {id(p) for p in params}
                        for b, params in enumerate(self.bucket_params)}
        self.requests = []

    def grads_done(self, params: list[Parameter]) -> None:
        """These gradients are complete for this step: start any bucket now full."""
        for p in params:
            b = self.bucket_of[id(p)]
            waiting = self.pending.get(b)
            if waiting is None:
                continue
            waiting.discard(id(p))
            if not waiting:
                del self.pending[b]
                self._launch(b)
                self.started_early += 1

    def _launch(self, b: int) -> None:
        self.requests.append(self.dp.iall_reduce(self.buckets[b]))
        self.started += 1

    def finish(self) -> None:
        """Start what the backward did not (a schedule without notifications), then wait."""
        for b in sorted(self.pending):
            self._launch(b)
        self.pending = {}
        start = perf_counter()
        Request.wait_all(self.requests)
        self.exposed_seconds += perf_counter() - start

    def reduce(self) -> None:
        """Sum every bucket over the group now (after a backward without notifications)."""
        self.start_step()
        self.finish()

    def zero_grad(self) -> None:
        for flat in self.buckets:
            flat[...] = 0


def local_sq_norm(params: list[Parameter], xp) -> float:
    """Sum of squares of the gradient elements this rank counts (``Parameter.counted``)."""
    # summed where the gradients are, read once (one device sync, not one per tensor)
    total = xp.zeros((), dtype=xp.float64)            # float64, as the float sum was
    for p in params:
        if p.counted:
            total += xp.vdot(p.grad.reshape(-1), p.grad.reshape(-1))
    return float(total)


def grad_norm(params: list[Parameter], group: Communicator | None = None) -> float:
    """The global L2 norm of the gradients, each element counted once: the counted elements
    of this rank, summed over ``group`` (the ranks that hold different pieces: tp and pp;
    never dp, whose replicas are equal after the reduction)."""
    sq = np.array([local_sq_norm(params, group.xp if group is not None else np)
                   if params else 0.0])
    if group is not None and group.size > 1:
        group.on_host().all_reduce(sq)
    return math.sqrt(float(sq[0]))
