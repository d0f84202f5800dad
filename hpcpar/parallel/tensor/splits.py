"""How one dimension of length n is cut over p ranks: the split rule, pure math.

Three ways, each exact and the same on every rank:

    even        n / p each; a length that does not divide is an error (pass sizes)
    sizes       given lengths, one per rank, adding up to n (uneven shards on purpose)
    units       whole units of ``unit`` elements (attention heads of head_dim): u = n / unit
                units, u / p per rank when p divides u; when u < p and u divides p, every
                unit is replicated on p / u consecutive ranks (GQA's KV heads over a larger
                tp group)

``bounds`` gives each rank's [start, stop); ``split`` and ``merge`` are exact inverses built on
it, for any dtype (float32/16, bfloat16, float64, integers). ``even_sizes`` is the
``numpy.array_split`` rule (remainder to the first ranks; the communicators' ``split_sizes``),
for callers who want uneven shards without choosing them.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import HpcparError


class ShardingError(HpcparError):
    """A length, sizes or unit that cannot be split as asked."""


def even_sizes(n: int, parts: int) -> list[int]:
    """Lengths of ``parts`` consecutive blocks of ``n`` items, remainder to the first blocks."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def unit_replicas(n: int, parts: int, unit: int = 1) -> int:
    """How many ranks hold each unit: 1 unless there are fewer units than ranks."""
    units = n // unit
    return parts // units if 0 < units < parts else 1


def bounds(n: int, parts: int, sizes: Sequence[int] | None = None, unit: int = 1,
           what: str = "dimension") -> list[tuple[int, int]]:
    """Every rank's [start, stop) of a dimension of length ``n`` cut over ``parts`` ranks."""
    if parts < 1:
        raise ShardingError(f"cannot split a {what} over {parts} ranks")
    if unit < 1 or n % unit:
        raise ShardingError(f"{what} of length {n} is not made of whole units of {unit}")
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != parts or sum(sizes) != n or min(sizes) < 0:
            raise ShardingError(f"sizes {sizes} for a {what} of length {n} over {parts} ranks "
                                f"must be {parts} non-negative lengths adding up to {n}")
        if any(s % unit for s in sizes):
            raise ShardingError(f"sizes {sizes} of a {what} must be whole units of {unit}")
        starts = [sum(sizes[:r]) for r in range(parts)]
        return [(s, s + n_r) for s, n_r in zip(starts, sizes)]
    units = n // unit
    if units % parts == 0:
        per = units // parts * unit
        return [(r * per, (r + 1) * per) for r in range(parts)]
    if unit > 1 and units > 0 and unit_split_problem(units, parts) is None:
        shared = parts // units                     # ranks r*shared .. hold unit r
        return [((r // shared) * unit, (r // shared + 1) * unit) for r in range(parts)]
    if unit > 1:
        raise ShardingError(
            f"{units} units of {unit} in a {what} of length {n} cannot be split evenly over "
            f"{parts} ranks: choose a rank count that divides {units} (or that {units} "
            f"divides, to replicate each unit), or give sizes")
    raise ShardingError(
        f"{what} of length {n} does not split evenly over {parts} ranks; pass "
        f"sizes={even_sizes(n, parts)} (or any {parts} lengths adding up to {n}) for uneven "
        f"shards")


def padded_vocab_size(vocab_size: int, parts: int) -> int:
    """The vocabulary rounded up to a multiple of ``parts``: every rank of a vocab-parallel
    layer holds the same number of rows (the last ones padding)."""
    return -(-vocab_size // parts) * parts


def vocab_range(vocab_size: int, rank: int, parts: int) -> tuple[int, int]:
    """The token ids [start, stop) that ``rank`` owns in a vocab-parallel layer: blocks of
    ceil(vocab / parts) rows, the last ones short (or empty)."""
    per = padded_vocab_size(vocab_size, parts) // parts
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def unit_split_problem(units: int, parts: int, replicate: bool = True) -> str | None:
    """Why ``units`` whole units (heads) cannot be cut over ``parts`` ranks, or None: each
    rank takes units / parts of them, or, with ``replicate``, when there are fewer units
    than ranks and they divide the ranks, every unit is held by parts / units ranks (GQA's
    KV heads over a larger tp group)."""
    if units % parts == 0 or (replicate and units < parts and parts % units == 0):
        return None
    if replicate:
        return f"{units} is neither a multiple nor a divisor of {parts}"
    return f"{units} is not divisible by {parts}"


def expert_block(num_experts: int, size: int, rank: int) -> range:
    """The experts rank ``rank`` of an expert-parallel group of ``size`` holds: a contiguous
    block of num_experts / size (Megatron-Core's order)."""
    if num_experts % size:
        raise ShardingError(f"{num_experts} experts do not split over ep {size}: choose an ep "
                            f"that divides {num_experts}")
    per = num_experts // size
    return range(rank * per, (rank + 1) * per)


def is_partition(cuts: list[tuple[int, int]]) -> bool:
    """Whether the blocks tile the dimension in rank order (no unit held twice)."""
    return all(cuts[r][1] == cuts[r + 1][0] for r in range(len(cuts) - 1))


def split(full, axis: int, parts: int, sizes: Sequence[int] | None = None,
          unit: int = 1) -> list:
    """Every rank's piece of ``full`` along ``axis``, in rank order (views of ``full``)."""
    axis = axis % full.ndim
    cuts = bounds(full.shape[axis], parts, sizes, unit, f"axis {axis}")
    index = [slice(None)] * full.ndim
    out = []
    for start, stop in cuts:
        index[axis] = slice(start, stop)
        out.append(full[tuple(index)])
    return out


def merge(pieces: Sequence, axis: int, sizes: Sequence[int] | None = None, unit: int = 1,
          length: int | None = None, xp=None):
    """The full array from every rank's piece along ``axis`` (inverse of ``split``). With
    replicated units pass the full ``length`` (the pieces alone cannot tell a replica from
    another unit); a replicated unit is taken from the last rank that holds it (all hold
    the same values)."""
    if xp is None:
        import numpy as xp
    first = pieces[0]
    axis = axis % first.ndim
    n = sum(p.shape[axis] for p in pieces) if length is None else length
    cuts = bounds(n, len(pieces), sizes, unit, f"axis {axis}")
    shape = list(first.shape)
    shape[axis] = n
    full = xp.empty(tuple(shape), dtype=first.dtype)
    index = [slice(None)] * first.ndim
    for r, ((start, stop), piece) in enumerate(zip(cuts, pieces)):
        if piece.shape[axis] != stop - start:
            raise ShardingError(f"piece {r} has length {piece.shape[axis]} along axis {axis}, "
                                f"the split gives it {stop - start}")
        index[axis] = slice(start, stop)
        full[tuple(index)] = piece
    return full
