"""Where an optimizer's parameters lie, so that a step is a few elementwise passes over
flat buffers (``data_parallel.flat_buffers``) whatever the number of tensors.

The parameters are grouped by dtype (master weights, gradients, a 16-bit compute copy) and
each group is put in the order of its gradients' buffer (a ``GradientReducer``'s, or ZeRO's
pieces), so the optimizer steps that buffer as it is. What lies in no buffer yet is moved
into a new one (``flat_buffers.adopt``), in that order: the master weights (and ``data``, the same
array in float32), a separate 16-bit copy, gradients no reducer holds. A group is then cut
into *runs*, spans that are contiguous in every buffer at once: one run per group when one
optimizer steps all of a reducer's parameters (or none), more where a buffer holds
parameters this optimizer does not.

A run is stepped in *blocks*: on the CPU cache-sized ones (``BLOCK`` elements, through a
scratch buffer of that size), on a device the whole run (one kernel per pass). Weight decay
applies to matrices only: a block whose elements all decay (or none) needs no mask; one
that mixes them gets a boolean mask made once, here, and the decay costs the block two
operations (multiply into the scratch, copy where the mask says). Two groups, decaying and
not, would cost more: every pass twice, and the gradients' buffer (in backward order, for
the buckets) cut where matrices and norms alternate.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from ..data_parallel.flat_buffers import Flat, adopt, home, in_buffer_order, runs, span_of


@dataclass
class Block:
    """Elements ``[start, stop)`` of a run, and how weight decay covers them: "all",
    "none", or "some" with ``mask`` (True where it decays: a device array)."""

    start: int
    stop: int
    decay: str
    mask: object = None


@dataclass
class Run:
    """Parameters that are one span of each buffer: ``first`` is the place of the first in
    its group (the states' spans), ``arrays`` the spans by attr ("master", "grad", "data":
    the 16-bit copy to refresh)."""

    params: list
    first: int
    arrays: dict
    blocks: list[Block]

    @property
    def size(self) -> int:
        return self.blocks[-1].stop if self.blocks else 0


@dataclass
class Group:
    """Parameters of one kind of arrays, in buffer order, cut into runs; ``states``: one flat
    buffer per optimizer state, made on first use."""

    params: list
    attrs: list[str]
    runs: list[Run]
    states: dict[str, Flat] = field(default_factory=dict)

    @property
    def largest(self) -> int:
        return max((r.size for r in self.runs), default=0)

    def state_spans(self, run: Run) -> dict:
        return {k: flat.span(run.first, run.first + len(run.params))
                for k, flat in self.states.items()}


def group_parameters(xp, params: list, block: int | None, weight_decay: float) -> list[Group]:
    """The groups of ``params`` (see the module docstring); ``block``: elements per block,
    None for whole runs; ``weight_decay``: 0 needs no masks."""
    kinds: dict[tuple, list] = {}
    for p in params:
        separate = None if p.data is p.master else p.data.dtype
        kinds.setdefault((p.master.dtype, p.grad.dtype, separate), []).append(p)
    return [_group(xp, members, block, weight_decay) for members in kinds.values()]


def _group(xp, members: list, block: int | None, weight_decay: float) -> Group:
    ordered = in_buffer_order(members, "grad")
    attrs = ["master", "grad"] + (["data"] if ordered[0].data is not ordered[0].master else [])
    for attr in attrs:
        loose = [p for p in ordered if home(p, attr) is None]
        if loose:                 # after those in a buffer (``in_buffer_order``): contiguous
            adopt(xp, loose, attr)
    cut = []
    for i, j in runs(ordered, attrs):
        part = ordered[i:j]
        decays = [bool(p.decay) and weight_decay != 0 for p in part]
        cut.append(Run(part, i, {a: span_of(part, a) for a in attrs},
                       _blocks(xp, [p.master.size for p in part], decays, block)))
    return Group(ordered, attrs, cut)


def _blocks(xp, sizes: list[int], decays: list[bool], block: int | None) -> list[Block]:
    """The run's blocks and their decay: masks only for blocks that mix both kinds, made on
    the host a block at a time and uploaded once."""
    offsets = [0, *accumulate(sizes)]
    n = offsets[-1]
    step = block or max(n, 1)
    out = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        i, j = bisect_right(offsets, start) - 1, bisect_left(offsets, stop)
        flags = [d for d, size in zip(decays[i:j], sizes[i:j]) if size]
        if all(flags) or not any(flags):
            out.append(Block(start, stop, "all" if all(flags) else "none"))
            continue
        mask = np.zeros(stop - start, dtype=bool)
        for k in range(i, j):
            if decays[k]:
                mask[max(offsets[k], start) - start:min(offsets[k + 1], stop) - start] = True
        out.append(Block(start, stop, "some", xp.asarray(mask)))
    return out
