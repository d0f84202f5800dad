"""How a distributed array lies along one mesh axis: sharded, replicated or a pending sum.

Small immutable values with a readable text form, one per mesh axis (as torch's DTensor and
JAX's PartitionSpec name them):

    Shard(0)                    dimension 0 cut evenly over the axis' ranks
    Shard(1, sizes=(5, 3))      cut at given lengths (uneven on purpose)
    Shard(0, unit=64)           cut by whole units of 64 (heads of head_dim 64); fewer units
                                than ranks: each unit replicated on ranks/units ranks
    Shard(0, padded=True)       cut in blocks of ceil(n / p), the last ones short (or empty),
                                every rank's buffer padded with zeros to the block's length
                                (a vocabulary over tp: every rank holds the same shape)
    Replicate()                 every rank of the axis holds the whole
    Partial()                   the array is the sum of the ranks' local arrays

Several mesh axes may shard the same dimension: the first (outer) axis cuts it, each later
one cuts the piece it was given. ``piece`` says where one rank's piece of a whole tensor
lies along one axis, for the checkpoint's pieces (``hpcpar.models.sharding``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import splits


@dataclass(frozen=True)
class Piece:
    """One rank's piece of a tensor: ``source``, the region of the whole tensor it holds;
    ``shape``, its buffer's; ``dest``, where ``source`` lands in the buffer (the rest is
    padding, zero)."""

    shape: tuple[int, ...]
    source: tuple[slice, ...]
    dest: tuple[slice, ...]

    @property
    def source_numel(self) -> int:
        return int(np.prod([s.stop - s.start for s in self.source], dtype=np.int64))

    def flat_regions(self, a: int, b: int):
        """Elements [a, b) of the piece's buffer (C order; 1-D or 2-D) as rectangles: for
        each, (the region of the whole tensor it holds, its first element, its shape, where
        that region lies in it). Padding (outside ``dest``) holds none of the tensor: a
        rectangle of padding alone is left out. ZeRO's pieces of a parameter are such
        element ranges, written and read as these regions."""
        for region, start in _rectangles(self.shape, a, b):
            src, sub = [], []
            for r, d, s in zip(region, self.dest, self.source):
                lo, hi = max(r.start, d.start), min(r.stop, d.stop)
                if lo >= hi:
                    break
                sub.append(slice(lo - r.start, hi - r.start))
                src.append(slice(s.start + lo - d.start, s.start + hi - d.start))
            else:
                yield tuple(src), start, tuple(r.stop - r.start for r in region), tuple(sub)


def _rectangles(shape: tuple[int, ...], a: int, b: int):
    """Elements [a, b) of a C-ordered 1-D or 2-D array as rectangles: (region, flat start)."""
    if len(shape) == 1:
        yield (slice(a, b),), a
        return
    cols = shape[1]
    r0, c0 = divmod(a, cols)
    r1, c1 = divmod(b, cols)
    if r0 == r1:
        yield (slice(r0, r0 + 1), slice(c0, c1)), a
        return
    if c0:
        yield (slice(r0, r0 + 1), slice(c0, cols)), a
        r0 += 1
    if r1 > r0:
        yield (slice(r0, r1), slice(0, cols)), r0 * cols
    if c1:
        yield (slice(r1, r1 + 1), slice(0, c1)), r1 * cols


def _whole(shape: tuple[int, ...]) -> Piece:
    full = tuple(slice(0, d) for d in shape)
    return Piece(tuple(shape), full, full)


@dataclass(frozen=True)
class Shard:
    dim: int
    sizes: tuple[int, ...] | None = None
    unit: int = 1
    padded: bool = False

    def __post_init__(self):
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if self.padded and (self.sizes is not None or self.unit != 1):
            raise splits.ShardingError(f"{self!r}: a padded shard takes neither sizes nor a "
                                       "unit (it cuts blocks of ceil(n / p))")

    def bounds(self, length: int, parts: int) -> list[tuple[int, int]]:
        """Every rank's [start, stop) of a dimension of ``length`` over ``parts`` ranks."""
        if self.padded:
            return [splits.vocab_range(length, r, parts) for r in range(parts)]
        return splits.bounds(length, parts, self.sizes, self.unit, f"dimension {self.dim}")

    def partitions(self, length: int, parts: int) -> bool:
        """Whether each element lives on exactly one rank (no replicated units)."""
        return splits.is_partition(self.bounds(length, parts))

    def piece(self, shape: tuple[int, ...], rank: int, parts: int) -> Piece:
        """Where rank ``rank`` of ``parts`` holds its piece of a tensor of ``shape``."""
        if parts == 1:
            return _whole(shape)
        start, stop = self.bounds(shape[self.dim], parts)[rank]
        length = (splits.padded_vocab_size(shape[self.dim], parts) // parts if self.padded
                  else stop - start)
        source = [slice(0, d) for d in shape]
        source[self.dim] = slice(start, stop)
        local = list(shape)
        local[self.dim] = length
        dest = [slice(0, d) for d in local]
        dest[self.dim] = slice(0, stop - start)
        return Piece(tuple(local), tuple(source), tuple(dest))

    def __repr__(self) -> str:
        extra = "".join([f", sizes={self.sizes}" if self.sizes is not None else "",
                         f", unit={self.unit}" if self.unit != 1 else "",
                         ", padded=True" if self.padded else ""])
        return f"Shard({self.dim}{extra})"


@dataclass(frozen=True)
class Replicate:
    def piece(self, shape: tuple[int, ...], rank: int, parts: int) -> Piece:
        """Every rank holds the whole tensor."""
        return _whole(shape)

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """A pending sum: the global array is the sum over the axis of every rank's local array."""

    def __repr__(self) -> str:
        return "Partial()"


Placement = Shard | Replicate | Partial
