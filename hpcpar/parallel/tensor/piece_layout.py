"""Where each rank's piece of a distributed array lies: placements checked against a mesh (at
every coordinate, not only this rank's), the bounds of every piece, and the fields the ranks
agree on about an array they make together. Pure functions, remembered where they repeat;
``darray`` and ``redistribute`` both stand on them.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Mapping, Sequence

from ..comm.agreement import dtype_name
from ..errors import HpcparError
from ..mesh import Mesh, MeshError
from .placement import Partial, Placement, Replicate, Shard


class PlacementError(HpcparError):
    """Placements that do not fit the array or the mesh."""


def normalize_placements(mesh: Mesh, placements, ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh axis: from a sequence in axis order, or a mapping by axis
    name whose missing axes are ``Replicate()``; one placement alone on a mesh of one axis.
    Pure: remembered for hashable input."""
    if isinstance(placements, (Shard, Replicate, Partial)):
        if len(mesh.axis_names) != 1:
            example = {mesh.axis_names[-1]: placements}
            raise PlacementError(f"one placement, {placements!r}, for a mesh of axes "
                                 f"{list(mesh.axis_names)}: give one per axis, or a dict by "
                                 f"axis name such as {example}")
        placements = [placements]
    elif not isinstance(placements, Iterable) or isinstance(placements, str):
        raise PlacementError(f"placements {placements!r}: give one per mesh axis (a list) or a "
                             f"dict by axis name, such as {{{mesh.axis_names[-1]!r}: Shard(0)}}")
    named = isinstance(placements, dict) or (not isinstance(placements, (list, tuple))
                                             and isinstance(placements, Mapping))
    key = tuple(placements.items()) if named else tuple(placements)
    try:
        return _normalized(mesh.axis_names, key, named, ndim)
    except TypeError:                                 # an unhashable entry: the error below
        return _normalized.__wrapped__(mesh.axis_names, key, named, ndim)


@functools.lru_cache(maxsize=4096)
def _normalized(axis_names: tuple, key: tuple, named: bool, ndim: int) -> tuple:
    if named:
        given = dict(key)
        for name in given:
            if name not in axis_names:
                raise MeshError(f"the mesh has axes {list(axis_names)}, not {name!r}")
        out = tuple(given.get(n, Replicate()) for n in axis_names)
    else:
        out = key
        if len(out) != len(axis_names):
            raise PlacementError(f"{len(out)} placements for a mesh of {len(axis_names)} "
                                 f"axes {list(axis_names)}: give one per axis, or a dict")
    for name, p in zip(axis_names, out):
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise PlacementError(f"placement {p!r} on axis {name!r} is not Shard, Replicate "
                                 f"or Partial")
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise PlacementError(f"{p!r} on axis {name!r}: an array of {ndim} dimensions has "
                                 f"no dimension {p.dim}")
        if isinstance(p, Shard) and p.padded:
            raise PlacementError(f"{p!r} on axis {name!r}: a padded shard is a vocabulary-"
                                 f"parallel layer's (VocabParallelEmbedding, ParallelLMHead); "
                                 f"a DArray takes Shard({p.dim}) or Shard({p.dim}, sizes=...)")
    return tuple(Shard(p.dim % ndim, p.sizes, p.unit) if isinstance(p, Shard) else p
                 for p in out)


def placed(mesh: Mesh, placements, shape: Sequence[int]) -> tuple[Placement, ...]:
    """``normalize_placements``, and the placements checked to cut ``shape`` at every
    coordinate of the mesh, not only this rank's (nested uneven shards can fit one rank's
    piece and not another's: every rank must find that alike)."""
    out = normalize_placements(mesh, placements, len(shape))
    fits_everywhere(tuple(int(n) for n in shape), mesh.sizes, out)
    return out


@functools.lru_cache(maxsize=4096)
def fits_everywhere(shape: tuple, sizes: tuple, placements: tuple) -> None:
    """Raise the split's error if ``placements`` do not cut ``shape`` at some coordinate."""
    for flat in range(math.prod(sizes)):
        coords, rest = [], flat
        for n in reversed(sizes):
            rest, c = divmod(rest, n)
            coords.append(c)
        piece_bounds(shape, sizes, tuple(reversed(coords)), placements)


def shard_chain(placements: Sequence[Placement], dim: int) -> list[int]:
    """The mesh axes (indices) that shard ``dim``, outer first."""
    return [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


def piece_bounds(shape: Sequence[int], sizes: Sequence[int], coords: Sequence[int],
                 placements: Sequence[Placement]) -> tuple[tuple[int, int], ...]:
    """[start, stop) of the piece along every dimension held at mesh ``coords`` (pure)."""
    out = []
    for dim, length in enumerate(shape):
        start, n = 0, length
        for axis in shard_chain(placements, dim):
            lo, hi = placements[axis].bounds(n, sizes[axis])[coords[axis]]
            start, n = start + lo, hi - lo
        out.append((start, start + n))
    return tuple(out)


def attempt(fallback, fn, *args):
    """(fn(*args), None), or (``fallback``, the error) when it raises bad input: a rank's
    error is then shared with the other ranks before any raises (``Mesh.agree``)."""
    try:
        return fn(*args), None
    except HpcparError as e:
        return fallback, e


def placements_text(placements) -> str:
    """Placements as the ranks compare them: a dict by axis name, or a list in axis order."""
    if isinstance(placements, Mapping):
        return repr(sorted((str(k), repr(v)) for k, v in placements.items()))
    if not isinstance(placements, Iterable) or isinstance(placements, str):
        return repr(placements)                       # (bad input, reported once agreed)
    return repr([repr(p) for p in placements])


def given_key(value):
    """An argument as the caller gave it, as a hashable key: lists and dicts by their items
    (in order), told apart from tuples (whose text in the agreement fields differs)."""
    if isinstance(value, dict):
        return ("dict", *value.items())
    return ("list", *value) if isinstance(value, list) else value


def array_fields(shape, dtype, placements) -> list:
    """What the ranks must agree on about an array they make together (hashable values,
    so that a repeated check reuses its fingerprint)."""
    return [("global shape", tuple(int(n) for n in shape)), ("dtype", dtype_name(dtype)),
            ("placements", placements if isinstance(placements, tuple)
             else placements_text(placements))]
