"""From one list of placements to another with the fewest collectives.

``plan`` is pure: it returns the steps, each one operation over one mesh axis, that turn an
array placed as ``src`` into the same array placed as ``dst``:

    Shard(d)  -> Replicate   all_gather along d          Partial -> Replicate   all_reduce
    Partial   -> Shard(d)    reduce_scatter along d      Shard(d) -> Shard(e)   all_to_all
    Replicate -> Shard(d)    slice (no communication)    Shard(d) -> Partial    zero_pad (none)
    Replicate -> Partial     keep_one (zeros off coordinate 0; none)

When several mesh axes shard one dimension, the inner ones hold pieces of the outer ones'
pieces; so pieces come together innermost axis first (the axes in reverse), and are cut
again outermost first. A direct all_to_all / reduce_scatter is used when no other axis
shards the dimensions involved and the shard is a partition (no replicated units);
otherwise the step goes through Replicate. ``redistribute`` runs a plan; the source array
is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..comm.agreement import trusted
from .darray import (DArray, attempt, normalize_placements, piece_bounds, placements_text,
                     shard_chain)
from .placement import Partial, Placement, Replicate, Shard
from .splits import is_partition


@dataclass(frozen=True)
class Step:
    axis: int                  # mesh axis index
    op: str                    # all_gather, all_reduce, reduce_scatter, all_to_all, slice,
                               # zero_pad, keep_one
    src: Placement
    dst: Placement

    def text(self, axis_names: Sequence[str]) -> str:
        return f"{self.op} over {axis_names[self.axis]!r}: {self.src!r} -> {self.dst!r}"


COMMUNICATING = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def plan(shape: Sequence[int], sizes: Sequence[int], src: Sequence[Placement],
         dst: Sequence[Placement]) -> list[Step]:
    """The steps from ``src`` to ``dst`` placements (one per mesh axis of ``sizes``)."""
    state = list(src)
    steps: list[Step] = []

    def alone(axis: int, dim: int) -> bool:
        """No other axis shards ``dim``, before or after."""
        return all(i == axis for i in shard_chain(src, dim) + shard_chain(dst, dim))

    def kept(i: int) -> bool:
        """A shard that stays: same placement, and every outer shard of its dim too."""
        p = src[i]
        return p == dst[i] and all(src[k] == dst[k] for k in range(i)
                                   if k in shard_chain(src, p.dim) + shard_chain(dst, p.dim))

    def move(i: int, op: str, to: Placement) -> None:
        steps.append(Step(i, op, state[i], to))
        state[i] = to

    # gather (innermost first)
    for i in reversed(range(len(sizes))):
        cur, tgt = state[i], dst[i]
        if isinstance(cur, Shard):
            if kept(i):
                continue
            if isinstance(tgt, Shard) and tgt.dim != cur.dim and alone(i, cur.dim) \
                    and alone(i, tgt.dim) and _partitions(cur, shape, sizes[i], src, i) \
                    and _partitions(tgt, shape, sizes[i], dst, i):
                move(i, "all_to_all", tgt)
            elif isinstance(tgt, Partial) and _partitions(cur, shape, sizes[i], src, i):
                move(i, "zero_pad", tgt)
            else:
                move(i, "all_gather", Replicate())
        elif isinstance(cur, Partial) and not isinstance(tgt, Partial):
            if isinstance(tgt, Shard) and alone(i, tgt.dim) \
                    and _partitions(tgt, shape, sizes[i], dst, i):
                move(i, "reduce_scatter", tgt)
            else:
                move(i, "all_reduce", Replicate())
    # cut (outermost first)
    for i in range(len(sizes)):
        cur, tgt = state[i], dst[i]
        if cur == tgt:
            continue
        if isinstance(tgt, Shard):
            move(i, "slice", tgt)
        elif isinstance(tgt, Partial):
            move(i, "keep_one", tgt)
    return steps


def _partitions(p: Shard, shape: Sequence[int], parts: int, placements, axis: int) -> bool:
    """Whether every element of the shard lives on one rank of the axis (the same answer on
    every rank: a unit-wise shard nested under another axis counts as replicating)."""
    if p.unit == 1:
        return True
    return shard_chain(placements, p.dim) == [axis] and p.partitions(shape[p.dim], parts)


def redistribute(x: DArray, placements) -> DArray:
    """``x`` placed as ``placements`` (see the module docstring); collective over the mesh
    axes whose placement changes."""
    dst, error = attempt(placements, normalize_placements, x.mesh, placements, x.ndim)
    if x.mesh.checking:
        x.mesh.agree("redistribute", x.agreement_fields()
                     + [("target placements", placements_text(dst))], error)
    elif error is not None:
        raise error
    local, state = x.local, list(x.placements)
    with trusted():
        for step in plan(x.shape, x.mesh.sizes, x.placements, dst):
            before = tuple(state)
            state[step.axis] = step.dst
            local = _run(step, local, x, before, tuple(state))
        return DArray(local, x.shape, x.mesh, dst)


def _run(step: Step, local, x: DArray, before, after):
    """One step on this rank's piece: ``before`` -> ``after`` placements."""
    mesh, i = x.mesh, step.axis
    group = mesh.group(mesh.axis_names[i])
    xp = mesh.backend.xp
    if step.op == "all_reduce":
        return group.all_reduce(local.copy())
    if step.op == "keep_one":
        return local.copy() if mesh.coords[i] == 0 else xp.zeros_like(local)
    if step.op == "slice":
        region = _relative(x.shape, mesh, before, after)
        return local[region].copy()
    if step.op == "zero_pad":
        outer = _shape_at(x.shape, mesh, after)
        out = xp.zeros(outer, dtype=local.dtype)
        out[_relative(x.shape, mesh, after, before)] = local
        return out
    cuts = _cuts_along(x.shape, mesh, i, before if step.op != "reduce_scatter" else after)
    if step.op == "all_gather":
        dim = step.src.dim
        sizes = [b - a for a, b in cuts]
        gathered = group.all_gather(local, axis=dim, sizes=sizes)
        if is_partition(cuts):
            return gathered
        return _assemble(xp, gathered, dim, cuts, _shape_at(x.shape, mesh, after))
    if step.op == "reduce_scatter":
        return group.reduce_scatter(local, axis=step.dst.dim, sizes=[b - a for a, b in cuts])
    if step.op == "all_to_all":
        src_cuts = _cuts_along(x.shape, mesh, i, before)
        dst_cuts = _cuts_along(x.shape, mesh, i, after)
        return group.all_to_all(local, split_axis=step.dst.dim, concat_axis=step.src.dim,
                                split_sizes=[b - a for a, b in dst_cuts],
                                concat_sizes=[b - a for a, b in src_cuts])
    raise ValueError(f"unknown redistribution step {step.op!r}")


def _shape_at(shape, mesh, placements) -> tuple[int, ...]:
    return tuple(b - a for a, b in piece_bounds(shape, mesh.sizes, mesh.coords, placements))


def _relative(shape, mesh, outer, inner) -> tuple[slice, ...]:
    """Where this rank's piece under ``inner`` lies inside its piece under ``outer``."""
    big = piece_bounds(shape, mesh.sizes, mesh.coords, outer)
    small = piece_bounds(shape, mesh.sizes, mesh.coords, inner)
    return tuple(slice(s[0] - b[0], s[1] - b[0]) for b, s in zip(big, small))


def _cuts_along(shape, mesh, axis: int, placements) -> list[tuple[int, int]]:
    """The pieces of the ranks of ``axis``' group along the dim sharded by ``axis``,
    relative to the piece they share one level out."""
    p = placements[axis]
    coords = list(mesh.coords)
    out = []
    for c in range(mesh.sizes[axis]):
        coords[axis] = c
        here = piece_bounds(shape, mesh.sizes, coords, placements)[p.dim]
        out.append(here)
    base = min(a for a, _ in out)
    return [(a - base, b - base) for a, b in out]


def _assemble(xp, gathered, dim: int, cuts, shape):
    """Pieces concatenated in rank order -> the array they tile, replicas written once."""
    out = xp.empty(shape, dtype=gathered.dtype)
    index = [slice(None)] * len(shape)
    offset = 0
    for a, b in cuts:
        index[dim] = slice(a, b)
        src = [slice(None)] * len(shape)
        src[dim] = slice(offset, offset + b - a)
        out[tuple(index)] = gathered[tuple(src)]
        offset += b - a
    return out
