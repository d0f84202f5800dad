"""What the ranks of a group must agree on, checked with one small all-reduce.

SPMD code goes wrong silently when ranks disagree about what they pass to a collective: MPI
moves as many bytes as each rank says, so operands of different global shapes make a rank
read memory nobody wrote, and different placements or meshes make ranks cut one array two
ways. ``agree(group, what, fields)`` hashes the fields (labelled values, compared by their
``repr``) into 63 bits and reduces ``(h, -h)`` by max over the group: both maxima equal
``h`` only when every rank holds the same hash. That is one all-reduce of two integers
(measured with the hashing: 6-8 us on 2 ranks, 30-40 us on 4 ranks sharing 2 cores, where a
1 MB all-gather takes 80 and 200-300 us); the hash of fields seen before is remembered.
Only on a mismatch do the ranks exchange their fields' texts, and every rank
raises the same ``Disagreement`` naming the first field that differs and which ranks hold
which value.

A check can also carry a rank's own error (bad input found before the call): every rank
then raises, those without it too, instead of some waiting in a collective for the others.
An error raised so is marked with the ranks that raised it together (``agreed``): no rank of
the call is left waiting for another, so nobody needs to be told (``failfast``).

Checks do not nest: inside ``trusted()`` the operations a checked call makes (its
redistributions, its collectives) are not checked again, since they follow from what was
agreed. A group checks only when its ``check`` flag is set (``hpcpar.parallel.Mesh`` sets it
on its groups unless built with ``check=False``; the jobs' own groups leave it off).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from typing import Iterable, Sequence

import numpy as np

from ..errors import HpcparError
from ..device.waits import wait_bounded

Fields = Sequence[tuple[str, object]]       # (label, value): what must be the same
ERROR = "error"                             # the label of a rank's own error, if any

_local = threading.local()


class Disagreement(HpcparError):
    """Ranks of one group passed different shapes, dtypes, placements, meshes or counts to
    an operation they run together; raised on every rank of the group with the same text."""


_local.depth = 0


def _depth() -> int:
    return getattr(_local, "depth", 0)


class _Trusted:
    """The operations made inside are not checked (what they move was agreed already)."""

    def __enter__(self):
        _local.depth = _depth() + 1

    def __exit__(self, *exc):
        _local.depth -= 1


_TRUSTED = _Trusted()


def trusted() -> _Trusted:
    return _TRUSTED


def fingerprint(fields: Fields) -> int:
    """A 63-bit hash of the fields, the same in every process (not Python's ``hash``);
    remembered for hashable fields, so that a check repeated in a loop costs a lookup."""
    try:
        return _remembered(tuple(fields))
    except TypeError:                                  # a list among the values
        return _fingerprint(fields)


@functools.lru_cache(maxsize=4096)
def _remembered(fields: tuple) -> int:
    return _fingerprint(fields)


def _fingerprint(fields: Fields) -> int:
    text = "\x1f".join(f"{label}={value!r}" for label, value in fields)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """``str(dtype)``, remembered (NumPy computes a dtype's name in Python each time)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def agree_mpi(mpi_comm, what: str, fields: Fields, timeout: float = 0.0,
              error: Exception | None = None) -> None:
    """Raise ``Disagreement`` on every rank of the mpi4py communicator ``mpi_comm`` unless
    all of them pass equal ``fields`` and the same ``error`` (this rank's own, found before
    the call; every rank then raises it). Collective; waits at most ``timeout`` seconds."""
    if mpi_comm.Get_size() == 1:
        if error is not None:
            raise agreed(error, mpi_comm)
        return
    try:
        Check(mpi_comm, what, list(fields) + [(ERROR, "" if error is None else str(error))],
              timeout)()
    except Disagreement as e:
        raise agreed(e, mpi_comm) from None
    if error is not None:
        raise agreed(error, mpi_comm)


def agreed(error: Exception, mpi_comm) -> Exception:
    """``error``, marked as raised on every rank of ``mpi_comm`` at once: ``agreed_ranks``,
    the world ranks known to raise it together (more as it passes further agreements). A
    call over those ranks leaves none of them waiting, and nobody is told of it
    (``failfast.fails_together``)."""
    error.agreed_ranks = getattr(error, "agreed_ranks", frozenset()) | frozenset(
        world_ranks_of(mpi_comm))
    return error


class Check:
    """One agreement worked out ahead: the fingerprint of ``fields`` hashed once, so that a
    check repeated in a loop (a redistribution, a layer's forward) costs the all-reduce of
    two integers and no Python work on the fields. Call it to check (collective)."""

    def __init__(self, mpi_comm, what: str, fields: Fields, timeout: float = 0.0):
        from mpi4py import MPI
        self.mpi_comm, self.what, self.fields, self.timeout = mpi_comm, what, fields, timeout
        self.h = fingerprint(fields)
        self._waiting = f"{what}: rank {MPI.COMM_WORLD.Get_rank()} checking that the ranks agree"
        self._in_place, self._max = MPI.IN_PLACE, MPI.MAX   # MPI is imported on first use

    def __call__(self) -> None:
        h = self.h
        extremes = np.array([h, -h], dtype=np.int64)
        wait_bounded(self.mpi_comm.Iallreduce(self._in_place, extremes, op=self._max), self.timeout,
                     self._waiting)
        if extremes[0] != h or extremes[1] != -h:        # every rank sees it: raised together
            raise agreed(Disagreement(_describe(self.mpi_comm, self.what, self.fields,
                                                self.timeout)), self.mpi_comm)


def active(group) -> bool:
    """Whether ``agree`` over ``group`` would check now (it checks, has several ranks, and
    this is not inside a checked call): callers skip building the fields otherwise."""
    return group is not None and group.check and group.size > 1 and not _depth()


def agree(group, what: str, fields: Fields, error: Exception | None = None) -> None:
    """``agree_mpi`` over a ``Communicator``'s ranks, when it checks (``active``); else
    only this rank's ``error`` is raised."""
    if not active(group):
        if error is not None:
            # a group of one: this rank is the whole call (else only this rank knows it)
            raise agreed(error, group.mpi_comm) if group is not None and group.size == 1 \
                else error
        return
    agree_mpi(group.mpi_comm, what, fields, group.timeout, error)


def _describe(mpi_comm, what: str, fields: Fields, timeout: float) -> str:
    """The first field whose value differs, and the (world) ranks holding each value."""
    mine = json.dumps([_short(value, 300) if label == ERROR else _short(_text(value))
                       for label, value in fields]).encode()
    lengths = np.zeros(mpi_comm.Get_size(), dtype=np.int64)
    wait_bounded(mpi_comm.Iallgather(np.array([len(mine)], dtype=np.int64), lengths), timeout,
                 what)
    width = int(lengths.max())
    padded = np.zeros(width, dtype=np.uint8)
    padded[:len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    table = np.zeros((mpi_comm.Get_size(), width), dtype=np.uint8)
    wait_bounded(mpi_comm.Iallgather(padded, table), timeout, what)
    values = [json.loads(row[:n].tobytes()) for row, n in zip(table, lengths)]
    ranks = world_ranks_of(mpi_comm)
    errors = [v[-1] for v in values]
    if len(set(errors)) > 1:            # a rank's own error first: it says what to change
        text = next(e for e in errors if e)
        failed = [r for r, e in zip(ranks, errors) if e == text]
        prefix = "" if text.startswith(what.split()[0]) else f"{what}: "
        return f"{prefix}{text} (found on {_rank_list(failed)})"
    for i, (label, _) in enumerate(fields):
        column = [v[i] if i < len(v) else "(nothing)" for v in values]
        if len(set(column)) > 1:
            holders = " and ".join(
                f"{value} on {_rank_list(r for r, v in zip(ranks, column) if v == value)}"
                for value in dict.fromkeys(column))
            return (f"{what}: the ranks disagree on {label}: {holders}; every rank of the group "
                    f"must pass the same {label}")
    labels = [label for label, _ in fields]
    if any(len(v) != len(labels) for v in values):
        return f"{what}: the ranks passed different sets of arguments"
    # equal texts, different hashes: values whose repr is cut short differ past the cut
    return f"{what}: the ranks disagree on one of {', '.join(labels)} (values too long to show)"


def _text(value) -> str:
    return value if isinstance(value, str) else repr(value)


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _rank_list(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def world_ranks_of(mpi_comm) -> list[int]:
    """The world rank of each rank of ``mpi_comm``, in its order (names users recognise)."""
    from mpi4py import MPI
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        out = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    return [int(r) for r in out]
