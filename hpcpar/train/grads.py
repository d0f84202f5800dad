"""Gradients after the backward: the data-parallel reduction in buckets, the sums over ranks
that hold the same tensor, and the global norm.

Data parallelism: the gradients of a stage live in a few flat buffers (buckets), filled in
the order the backward completes them (head first, embedding last: reverse layer order).
As soon as every gradient of a bucket is complete, a non-blocking AllReduce of the whole
bucket starts over dp, so the reduction overlaps the rest of the backward; ``finish`` waits
for what is left and says how long it had to wait (the part not hidden).

Then two sums make replicated tensors' gradients whole:
- a KV head replicated on tp/kv ranks (kv_heads < tp) got a partial gradient on each of them
  (each from its own query heads): AllReduce over those ranks;
- a tied embedding held by the first and the last pipeline stage: the two gradients are
  exchanged and added on both, so both copies take the same step.
"""

from __future__ import annotations

from time import perf_counter

from ..comm import Communicator, Request
from .params import Param

BUCKET_BYTES = 25 << 20        # PyTorch DDP's default bucket size


class GradientReducer:
    """Buckets over ``groups`` (lists of params, in the order their gradients complete);
    every param's ``grad`` becomes a view into its bucket's flat buffer."""

    def __init__(self, dp: Communicator, groups: list[list[Param]], xp,
                 bucket_bytes: int = BUCKET_BYTES):
        self.dp, self.xp = dp, xp
        self.buckets: list = []                             # each bucket's flat buffer
        self.bucket_params: list[list[Param]] = []          # each bucket's params, in order
        self.bucket_of: dict[int, int] = {}
        current: list[Param] = []
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

    def _make_bucket(self, params: list[Param]) -> None:
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

    def grads_done(self, params: list[Param]) -> None:
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


def sum_replicated(params: list[Param], kv_group: Communicator | None,
                   tied_peer: tuple[Communicator, int] | None, xp) -> None:
    """Make replicated gradients whole (see the module docstring). ``tied_peer`` is the
    pipeline communicator and the other stage holding the tied embedding."""
    if kv_group is not None and kv_group.size > 1:
        for p in params:
            if p.kv_replicated:
                kv_group.all_reduce(p.grad)
    if tied_peer is not None:
        pp, peer = tied_peer
        embed = next(p for p in params if p.spec.role == "embed")
        theirs = xp.empty_like(embed.grad)
        pp.sendrecv(embed.grad, peer, theirs, peer, tag=77)
        # a + b == b + a exactly, so both copies hold the same sum and take the same step
        embed.grad += theirs


def local_sq_norm(params: list[Param], xp) -> float:
    """Sum of squares of the gradient elements this rank counts (``Param.counted``)."""
    # summed where the gradients are, read once (one device sync, not one per tensor)
    total = xp.zeros((), dtype=xp.float64)            # float64, as the float sum was
    for p in params:
        if p.counted:
            total += xp.vdot(p.grad.reshape(-1), p.grad.reshape(-1))
    return float(total)
