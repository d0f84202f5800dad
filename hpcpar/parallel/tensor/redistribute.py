"""From one list of placements to another with the fewest collectives.

``redistribution_steps`` is pure: it returns the steps, each one operation over one mesh axis, that
turn an array placed as ``src`` into the same array placed as ``dst``:

    Shard(d)  -> Replicate   all_gather along d          Partial -> Replicate   all_reduce
    Partial   -> Shard(d)    reduce_scatter along d      Shard(d) -> Shard(e)   all_to_all
    Replicate -> Shard(d)    slice (no communication)    Shard(d) -> Partial    zero_pad (none)
    Replicate -> Partial     keep_one (zeros off coordinate 0; none)

When several mesh axes shard one dimension, the inner ones hold pieces of the outer ones'
pieces; so pieces come together innermost axis first (the axes in reverse), and are cut
again outermost first. A direct all_to_all / reduce_scatter is used when no other axis
shards the dimensions involved and the shard is a partition (no replicated units);
otherwise the step goes through Replicate. ``redistribute`` runs the steps; the source array
is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .piece_layout import PlacementError, array_fields, piece_bounds, shard_chain
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


def redistribution_steps(shape: Sequence[int], sizes: Sequence[int], src: Sequence[Placement],
                         dst: Sequence[Placement]) -> list[Step]:
    """The steps from ``src`` to ``dst`` placements (one per mesh axis of ``sizes``)."""
    for name, given in (("src", src), ("dst", dst)):
        if not isinstance(given, (list, tuple)) or len(given) != len(sizes):
            raise PlacementError(
                f"redistribution_steps: {name} must be one placement per mesh axis, in order "
                f"({len(sizes)}), as x.placements is; got {given!r} (a dict by axis name needs "
                f"the mesh's names: [d.get(name, Replicate()) for name in mesh.axis_names])")
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


class Program:
    """One redistribution worked out for this rank: its agreement check (the fingerprint
    hashed once) and its moves bound to their groups' prepared collectives, so that a
    redistribution repeated in a loop costs its transfers and one small all-reduce."""

    def __init__(self, mesh, shape: tuple, dtype, src: tuple, dst: tuple):
        self.dst = dst
        self.check = mesh.check_for("redistribute", array_fields(shape, dtype, src)
                                    + [("target placements", dst)])
        steps = []
        state = list(src)
        for move in compiled(shape, mesh.sizes, mesh.coords, src, dst):
            piece = _shape_at(shape, mesh.sizes, mesh.coords, state)
            steps.append(_bound(move, piece, dtype, mesh))
            state[move.step.axis] = move.step.dst
        self.run = _chain(steps)                     # this rank's piece -> its new piece


def _chain(steps: list):
    """One function doing ``steps`` in order (most redistributions are one step)."""
    if len(steps) == 1:
        return steps[0]

    def run(local):
        for step in steps:
            local = step(local)
        return local
    return run


def _bound(move: "Move", piece: tuple, dtype, mesh):
    """A function doing ``move`` on this rank's ``piece`` (its shape) of ``dtype``."""
    step = move.step
    group = mesh.group(mesh.axis_names[step.axis])
    xp = mesh.backend.xp
    if step.op == "all_reduce":
        return lambda local: group.all_reduce(local.copy())
    if step.op == "keep_one":
        keep = mesh.coords[step.axis] == 0
        return lambda local: local.copy() if keep else xp.zeros_like(local)
    if step.op == "slice":
        return lambda local: local[move.region].copy()
    if step.op == "zero_pad":
        def pad(local):
            out = xp.zeros(move.shape, dtype=local.dtype)
            out[move.region] = local
            return out
        return pad
    if step.op == "all_gather":
        gather = group.all_gather_op(piece, dtype, axis=step.src.dim, sizes=move.lengths)
        if not move.cuts:
            return gather
        return lambda local: _assemble(xp, gather(local), step.src.dim, move.cuts, move.shape)
    if step.op == "reduce_scatter":
        return group.reduce_scatter_op(piece, dtype, axis=step.dst.dim, sizes=move.lengths)
    if step.op == "all_to_all":
        return group.all_to_all_op(piece, dtype, split_axis=step.dst.dim,
                                   concat_axis=step.src.dim, split_sizes=move.split,
                                   concat_sizes=move.lengths)
    raise ValueError(f"unknown redistribution step {step.op!r}")


@dataclass(frozen=True)
class Move:
    """A step with its numbers worked out for one rank (``compiled``)."""

    step: Step
    lengths: tuple = ()        # every rank's length along the dim gathered / scattered /
                               # concatenated (all_gather, reduce_scatter, all_to_all)
    split: tuple = ()          # all_to_all: every rank's length along the dim it splits
    region: tuple = ()         # slice: the new piece in the old; zero_pad: the old in the new
    shape: tuple = ()          # the new piece's shape (zero_pad, an assembled gather)
    cuts: tuple = ()           # all_gather of replicated units: where each rank's piece goes


def compiled(shape: tuple, sizes: tuple, coords: tuple, src: tuple, dst: tuple) -> tuple:
    """``redistribution_steps`` with every slice and length they need on the rank at ``coords``
    (pure; a ``Program`` binds them to the groups)."""
    state = list(src)
    moves = []
    for step in redistribution_steps(shape, sizes, src, dst):
        before = tuple(state)
        state[step.axis] = step.dst
        after = tuple(state)
        i, op = step.axis, step.op
        if op == "slice":
            moves.append(Move(step, region=_relative(shape, sizes, coords, before, after)))
        elif op == "zero_pad":
            moves.append(Move(step, region=_relative(shape, sizes, coords, after, before),
                              shape=_shape_at(shape, sizes, coords, after)))
        elif op == "all_gather":
            cuts = _cuts_along(shape, sizes, coords, i, before)
            moves.append(Move(step, lengths=tuple(b - a for a, b in cuts),
                              shape=_shape_at(shape, sizes, coords, after),
                              cuts=() if is_partition(cuts) else tuple(cuts)))
        elif op == "reduce_scatter":
            cuts = _cuts_along(shape, sizes, coords, i, after)
            moves.append(Move(step, lengths=tuple(b - a for a, b in cuts)))
        elif op == "all_to_all":
            moves.append(Move(step, lengths=tuple(b - a for a, b in _cuts_along(
                shape, sizes, coords, i, before)), split=tuple(b - a for a, b in _cuts_along(
                    shape, sizes, coords, i, after))))
        else:                                           # all_reduce, keep_one
            moves.append(Move(step))
    return tuple(moves)


def _shape_at(shape, sizes, coords, placements) -> tuple[int, ...]:
    return tuple(b - a for a, b in piece_bounds(shape, sizes, coords, placements))


def _relative(shape, sizes, coords, outer, inner) -> tuple[slice, ...]:
    """Where the piece at ``coords`` under ``inner`` lies inside its piece under ``outer``."""
    big = piece_bounds(shape, sizes, coords, outer)
    small = piece_bounds(shape, sizes, coords, inner)
    return tuple(slice(s[0] - b[0], s[1] - b[0]) for b, s in zip(big, small))


def _cuts_along(shape, sizes, coords, axis: int, placements) -> list[tuple[int, int]]:
    """The pieces of the ranks of ``axis``' group along the dim sharded by ``axis``,
    relative to the piece they share one level out."""
    p = placements[axis]
    coords = list(coords)
    out = []
    for c in range(sizes[axis]):
        coords[axis] = c
        out.append(piece_bounds(shape, sizes, coords, placements)[p.dim])
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
