"""Data parallelism over any model's parameters: gradients summed over replicas in buckets
while the backward runs, replicas' partial gradients summed, and the global gradient norm.

The gradients live in one flat buffer (one per dtype), in the order the backward completes
them (for a layered model: the last layer first), cut into buckets: spans of it, so a
bucket's AllReduce sums the gradients where they are. As soon as every gradient of a
bucket is complete (``grads_done``), a non-blocking AllReduce of the whole bucket starts over
the data-parallel group, so the reduction overlaps the rest of the backward; ``finish``
starts what is left and waits, and says how long it had to wait (the part not hidden).
Sums, as DDP's are before its division: divide the loss by the global batch to average.

One step's lifecycle, which cannot go wrong quietly:

    zero the gradients      reducer.zero_grad(), optimizer.zero_grad() or a param's zero_grad()
    backward                (grads_done(params) as gradients complete: optional, for overlap)
    reducer.finish()        every bucket summed over dp (reduce() is the same)
    optimizer.step()        refused unless finish() ran since the previous step

A second ``finish`` before the gradients are zeroed again is refused too: it would sum the
sums. The replicas are checked, when the reducer is made, to hold the same parameters.
"""

from __future__ import annotations

import math
from time import perf_counter

import numpy as np

from ..device.backend import array_module
from ..comm import Communicator, Request
from ..comm.agreement import trusted
from ..errors import HpcparError
from .flat_buffers import adopt, home
from ..params import Parameter, replica_groups

BUCKET_BYTES = 25 << 20        # PyTorch DDP's default bucket size


class GradientReducer:
    """Buckets over ``groups`` (lists of params, in the order their gradients complete);
    every param's ``grad`` becomes a view into one flat gradient buffer (one per dtype),
    whose spans the buckets are; the arrays it replaced are made read-only (``flat_buffers.adopt``).
    An optimizer made after it steps the same buffer, in the same order."""

    def __init__(self, dp: Communicator, groups: list[list[Parameter]], xp=None,
                 bucket_bytes: int = BUCKET_BYTES):
        self.dp, self.xp = dp, xp if xp is not None else dp.xp
        self.buckets: list = []                 # each bucket: a span of a buffer of ``flats``
        self.bucket_params: list[list[Parameter]] = []      # each bucket's params, in order
        self.bucket_of: dict[int, int] = {}
        self.views: dict[int, object] = {}                  # each param's grad, in its bucket
        unique = list({id(p): p for group in groups for p in group}.values())
        self.params = unique                                # each parameter once, in order
        taken = next((p for p in unique if p.reducer is not None), None)
        dp.agree("GradientReducer", [
            ("parameters (shape, dtype)", [(tuple(p.grad.shape), str(p.grad.dtype))
                                           for p in unique]),
            ("parameters per group", [len(g) for g in groups]), ("bucket_bytes", bucket_bytes)],
            None if taken is None else HpcparError(
                f"GradientReducer: parameter {_label(taken, unique)} already belongs to "
                f"another GradientReducer; make one per set of parameters"))
        self._make_buckets(_bucket_lists(groups, bucket_bytes))
        for p in unique:
            p.reducer = self
        self.pending: dict[int, set[int]] = {}
        self.requests: list[Request] = []
        self.open = False          # a step's reduction under way (grads_done / finish)
        self.summed = False        # finish() ran and the gradients were not zeroed since
        self.fresh = False         # ... and no optimizer step has used them yet
        self.exposed_seconds = 0.0          # waited for after the backward, over the run
        self.started_early = self.started = 0   # buckets launched during the backward / all

    def _make_buckets(self, buckets: list[list[Parameter]]) -> None:
        """One flat gradient buffer per dtype, its params in bucket order, so that each
        bucket is a span of it (``flat_buffers``): the AllReduce runs on the gradients themselves,
        nothing is copied into a bucket or out of it."""
        by_dtype: dict[object, list[Parameter]] = {}
        for params in buckets:
            by_dtype.setdefault(params[0].grad.dtype, []).extend(params)
        self.flats = [adopt(self.xp, params, "grad") for params in by_dtype.values()]
        for params in buckets:
            flat, first = home(params[0], "grad")
            self.buckets.append(flat.span(first, first + len(params)))
            self.bucket_params.append(list(params))
            for p in params:
                self.bucket_of[id(p)] = len(self.buckets) - 1
                self.views[id(p)] = p.grad

    def start_step(self) -> None:
        """A new step's reduction begins (implied by ``grads_done`` and ``finish``)."""
        self.pending = {b: {id(p) for p in params}
                        for b, params in enumerate(self.bucket_params)}
        self.requests = []
        self.reported: set[int] = set()     # params grads_done named in this step
        self.open, self.summed = True, False

    def step_begins(self) -> None:
        """The gradients were zeroed: the next ``finish`` sums new ones."""
        self.open = self.summed = False

    def grads_done(self, params: list[Parameter]) -> None:
        """These gradients are complete for this step: start any bucket now full. Name each
        parameter once a step, when its last micro-batch's gradient is in: a bucket's sum
        may start at once, and what is added after it would stay this replica's alone."""
        if not self.open:
            self._begin("grads_done")
        for p in params:
            b = self.bucket_of.get(id(p))
            if b is None:
                raise HpcparError(f"GradientReducer.grads_done: parameter {_label(p, [])} is "
                                  f"not one of this reducer's")
            if id(p) in self.reported:
                raise HpcparError(
                    f"GradientReducer.grads_done: parameter {_label(p, self.params)} was "
                    f"already reported complete in this step, and its bucket's sum over dp "
                    f"may have started without what came after; with gradient accumulation "
                    f"call grads_done in the last micro-batch's backward only (or not at "
                    f"all: finish() sums every bucket)")
            self.reported.add(id(p))
            waiting = self.pending.get(b)
            if waiting is None:
                continue
            waiting.discard(id(p))
            if not waiting:
                del self.pending[b]
                self._launch(b)
                self.started_early += 1

    def _begin(self, what: str) -> None:
        if self.summed:
            raise HpcparError(
                f"GradientReducer.{what}: the gradients were already summed over dp and not "
                f"zeroed since; summing them again would multiply them by the replicas. Zero "
                f"them (optimizer.zero_grad() or reducer.zero_grad()) before the next backward")
        self.start_step()

    def _launch(self, b: int) -> None:
        with trusted():                 # the buckets were agreed on when they were made
            self.requests.append(self.dp.iall_reduce(self.buckets[b]))
        self.started += 1

    def finish(self) -> None:
        """Start what the backward did not (a schedule without notifications), then wait:
        every gradient is then summed over dp, and an optimizer step may use it."""
        if not self.open:
            self._begin("finish")
        self._check_views()
        for b in sorted(self.pending):
            self._launch(b)
        self.pending = {}
        start = perf_counter()
        Request.wait_all(self.requests)
        self.exposed_seconds += perf_counter() - start
        self.open, self.summed, self.fresh = False, True, True

    def reduce(self) -> None:
        """Sum every bucket over the group now (after a backward without notifications)."""
        self.finish()

    def zero_grad(self) -> None:
        for flat in self.flats:               # one operation per buffer, not per bucket
            flat.buffer[...] = 0
        self.step_begins()

    def use_for_step(self) -> None:
        """An optimizer step is about to use the gradients: they must be this step's sums."""
        if not self.fresh:
            raise HpcparError(
                "optimizer step on gradients that were not summed over the data-parallel "
                "replicas since the last step: call reducer.finish() (or reducer.reduce()) "
                "after the backward, before optimizer.step()")
        self.fresh = False

    def _check_views(self) -> None:
        """Every gradient still lives in its bucket: one replaced by a new array would be
        left out of the sum."""
        for params in self.bucket_params:
            for p in params:
                if p.grad is not self.views[id(p)]:
                    raise HpcparError(
                        f"GradientReducer: the gradient of parameter {_label(p, self.params)} was "
                        f"replaced by a new array, which the sum over dp would miss; add into "
                        f"it in place (p.grad += ..., p.zero_grad())")


def _bucket_lists(groups: list[list[Parameter]], bucket_bytes: int) -> list[list[Parameter]]:
    """The params of each bucket: each param once, in order; a bucket closes at the end of
    a group once it holds ``bucket_bytes``, and where the gradients' dtype changes (a
    bucket is one span of one buffer)."""
    out: list[list[Parameter]] = []
    current: list[Parameter] = []
    size = 0
    seen: set[int] = set()
    for group in groups:
        for p in group:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if current and p.grad.dtype != current[0].grad.dtype:
                out.append(current)
                current, size = [], 0
            current.append(p)
            size += p.grad.nbytes
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def _label(p: Parameter, among) -> str:
    """A parameter as a user recognises it: its name, or its place and shape."""
    if p.name:
        return repr(p.name)
    index = next((i for i, q in enumerate(among) if q is p), None)
    return f"{index} of shape {tuple(p.grad.shape)}" if index is not None \
        else f"of shape {tuple(p.grad.shape)}"


def sum_partial_grads(params: list[Parameter]) -> None:
    """Make replicated parameters' gradients whole: a parameter whose replicas each added
    a part of the gradient (``partial_grad``: a KV head held by several tp ranks, each with
    its own query heads) gets the sum over its ``replicas``. Run it after the backward, with
    the data-parallel ``finish`` (either order)."""
    with trusted():
        for p in params:
            if owes_partial_sum(p):
                for group in replica_groups(p):           # a product: one factor at a time
                    group.all_reduce(p.grad)
                p.partial_summed = True


def owes_partial_sum(p: Parameter) -> bool:
    """``p``'s replicas each add a part of its gradient (``sum_partial_grads`` sums them)."""
    return p.partial_grad and any(g.size > 1 for g in replica_groups(p))


def check_partial_sums(params: list[Parameter], among: list[Parameter], what: str) -> None:
    """Refuse ``what`` (a gradient norm, an optimizer step) on a partial gradient not summed
    since the last step: each replica would go on with its own part."""
    for p in params:
        if owes_partial_sum(p) and not p.partial_summed:
            raise HpcparError(
                f"{what} on parameter {_label(p, among)}, whose replicas each hold a part of "
                f"its gradient (partial_grad) not summed since the last step: call "
                f"sum_partial_grads(params) after the backward")


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
    of this rank (``Parameter.counted``: a replica other than the first is not), summed over
    ``group``, the ranks that hold different pieces of the model (tp, pp, cp's ranks hold
    the same weights: leave cp out), never its data-parallel replicas, whose gradients are
    equal after the reduction. A group that includes a parameter's dp replicas, or leaves
    out its other replicas, is an error (each would count a wrong number of copies)."""
    _check_norm_group(params, group)
    check_partial_sums(params, params, "grad_norm")
    xp = group.xp if group is not None else array_module(params[0].grad) if params else np
    sq = np.array([local_sq_norm(params, xp) if params else 0.0])
    if group is not None and group.size > 1:
        with trusted():
            group.on_host().all_reduce(sq)
    return math.sqrt(float(sq[0]))


def _check_norm_group(params: list[Parameter], group: Communicator | None) -> None:
    """The norm's group holds every replica of each replicated parameter, and none of its
    data-parallel replicas but those that are also its replicas (an MoE router, summed over
    ep as over dp and replicated over it: counted once among them), so that each element
    counts once (the same answer on every rank of a consistent program)."""
    members = set(world_ranks(group)) if group is not None else set()
    from mpi4py import MPI
    me = MPI.COMM_WORLD.Get_rank()
    members = members or {me}
    checked: set = set()
    for p in params:
        replicas = [g for g in replica_groups(p) if g.size > 1]
        dp = p.reducer.dp if p.reducer is not None and p.reducer.dp.size > 1 else None
        key = (tuple(id(g) for g in replicas), id(dp))
        if key in checked:
            continue
        checked.add(key)
        holders = {r for g in replicas for r in world_ranks(g)}
        if any(not set(world_ranks(g)) <= members for g in replicas):
            problem = "replicas only in part, so the ranks would disagree on the norm"
        elif dp is not None and (set(world_ranks(dp)) & members) - holders - {me}:
            problem = "data-parallel replicas, whose equal gradients would count several times"
        else:
            continue
        raise HpcparError(
            f"grad_norm: the group {group.name if group else '(none)'} holds a parameter's "
            f"{problem}; pass the group of the ranks that hold different pieces of the "
            f"model, e.g. mesh.group(('pp', 'tp'))")


def world_ranks(group: Communicator | None) -> list[int]:
    """The world ranks of a group's members, in group order (cached on the group)."""
    return [] if group is None else list(group.world_ranks())
