"""Gradients after the backward: the data-parallel reduction in buckets and the global norm
are the core's (``hpcpar.parallel.data_parallel.reducer``); here the sums over the ranks that hold
the same model tensor.

Three sums make replicated tensors' gradients whole:
- a KV head replicated on tp/kv ranks (kv_heads < tp) got a partial gradient on each of them
  (each from its own query heads): AllReduce over those ranks;
- a per-head norm's weight (Qwen3's q/k norms), shared by every head while each tp rank
  holds its own heads, and under sequence parallelism every norm's weight (each tp rank
  normalizes its own positions): AllReduce over the tp group, all of them in one;
- a tied embedding held by the first and the last pipeline stage: the two gradients are
  exchanged and added on both, so both copies take the same step.
"""

from __future__ import annotations

from ...parallel.comm import Communicator
from .params import Param


def sum_replicated(params: list[Param], kv_group: Communicator | None,
                   tied_peer: tuple[Communicator, int] | None, xp,
                   tp: Communicator | None = None) -> None:
    """Make replicated gradients whole (see the module docstring). ``tied_peer`` is the
    pipeline communicator and the other stage holding the tied embedding."""
    if kv_group is not None and kv_group.size > 1:
        for p in params:
            if p.kv_replicated:
                kv_group.all_reduce(p.grad)
    if tp is not None and tp.size > 1:
        _sum_over_tp([p for p in params if p.tp_partial], tp, xp)
    if tied_peer is not None:
        pp, peer = tied_peer
        embed = next(p for p in params if p.spec.role == "embed")
        theirs = xp.empty_like(embed.grad)
        pp.sendrecv(embed.grad, peer, theirs, peer, tag=77)
        # a + b == b + a exactly, so both copies hold the same sum and take the same step
        embed.grad += theirs


def _sum_over_tp(params: list[Param], tp: Communicator, xp) -> None:
    """Each gradient of ``params`` summed over ``tp``: one AllReduce of them all (a norm's
    weight per layer under sequence parallelism: many small tensors)."""
    if not params:
        return
    flat = tp.all_reduce(xp.concatenate([p.grad.reshape(-1) for p in params]))
    at = 0
    for p in params:
        p.grad[...] = flat[at:at + p.grad.size].reshape(p.grad.shape)
        at += p.grad.size
