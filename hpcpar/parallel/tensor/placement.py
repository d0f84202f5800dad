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
