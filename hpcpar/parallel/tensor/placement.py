"""How a distributed array lies along one mesh axis: sharded, replicated or a pending sum.

Small immutable values with a readable text form, one per mesh axis (as torch's DTensor and
JAX's PartitionSpec name them):

    Shard(0)                    dimension 0 cut evenly over the axis' ranks
    Shard(1, sizes=(5, 3))      cut at given lengths (uneven on purpose)
    Shard(0, unit=64)           cut by whole units of 64 (heads of head_dim 64); fewer units
                                than ranks: each unit replicated on ranks/units ranks
    Replicate()                 every rank of the axis holds the whole
    Partial()                   the array is the sum of the ranks' local arrays

Several mesh axes may shard the same dimension: the first (outer) axis cuts it, each later
one cuts the piece it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import splits


@dataclass(frozen=True)
class Shard:
    dim: int
    sizes: tuple[int, ...] | None = None
    unit: int = 1

    def __post_init__(self):
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))

    def bounds(self, length: int, parts: int) -> list[tuple[int, int]]:
        """Every rank's [start, stop) of a dimension of ``length`` over ``parts`` ranks."""
        return splits.bounds(length, parts, self.sizes, self.unit, f"dimension {self.dim}")

    def partitions(self, length: int, parts: int) -> bool:
        """Whether each element lives on exactly one rank (no replicated units)."""
        return splits.is_partition(self.bounds(length, parts))

    def __repr__(self) -> str:
        extra = "".join([f", sizes={self.sizes}" if self.sizes is not None else "",
                         f", unit={self.unit}" if self.unit != 1 else ""])
        return f"Shard({self.dim}{extra})"


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """A pending sum: the global array is the sum over the axis of every rank's local array."""

    def __repr__(self) -> str:
        return "Partial()"


Placement = Shard | Replicate | Partial
