"""Flat buffers: several tensors end to end in one contiguous array, each tensor a view of
it, so that one elementwise operation over the buffer is that operation over every tensor
it holds (one kernel on a GPU, however many tensors).

A ``Flat`` holds one kind of array of a list of parameters (their gradients, their master
weights, one optimizer state) in one order. Whoever makes it binds each parameter's array
to its view and records where it lies (``Parameter.homes``), so the next user of the same
parameters finds the buffer instead of making another:

    GradientReducer     the gradients, in bucket order (a bucket is a span of them: nothing
                        is copied into or out of it)
    ZeRO's shards       the replicated master weights, and this rank's pieces of the
                        weights and the gradients
    Optimizer           what no one placed yet (master weights, a 16-bit compute copy,
                        gradients) and its own state, in the order of the gradients

``adopt`` copies arrays into a new buffer and makes the arrays it replaced read-only where
the backend can (NumPy, the strict backend; CuPy has no read-only arrays), so code that kept
one and writes into it fails at once, instead of training a copy nobody reads.
"""

from __future__ import annotations

import math
from itertools import accumulate


class Flat:
    """Arrays of ``shapes`` end to end in one contiguous 1-D ``buffer`` of ``dtype``;
    ``views[i]`` is array i, a view of the buffer at ``offsets[i]``."""

    def __init__(self, xp, shapes, dtype, zero: bool = True):
        shapes = [tuple(s) for s in shapes]
        self.offsets = [0, *accumulate(math.prod(s) for s in shapes)]
        make = xp.zeros if zero else xp.empty
        self.buffer = make(self.offsets[-1], dtype=dtype)
        self.views = [self.buffer[a:b].reshape(s)
                      for a, b, s in zip(self.offsets, self.offsets[1:], shapes)]

    def __len__(self) -> int:
        return len(self.views)

    def span(self, start: int, stop: int):
        """Arrays ``start`` .. ``stop - 1`` as one 1-D view."""
        return self.buffer[self.offsets[start]:self.offsets[stop]]

    def place(self, params, attr: str) -> None:
        """Bind ``params[i].<attr>`` to view i (no copy) and record where it lies."""
        for i, p in enumerate(params):
            setattr(p, attr, self.views[i])
            p.homes[attr] = (self, i)


def adopt(xp, params, attr: str) -> Flat:
    """Copy ``params``' ``attr`` arrays (``grad``, ``master`` or ``data``: one dtype), in
    order, into one new flat buffer and bind each to its view; a ``data`` that is its master
    follows it. The arrays replaced become read-only where the backend allows."""
    olds = [getattr(p, attr) for p in params]
    flat = Flat(xp, [a.shape for a in olds], olds[0].dtype, zero=False)
    for p, old, view in zip(params, olds, flat.views):
        view[...] = old
        if attr == "master" and p.data is old:
            p.data = view
    flat.place(params, attr)
    for old in olds:
        _retire(old)
    return flat


def _retire(array) -> None:
    """A replaced array: read-only where the backend has the flag (a write into a stale copy
    would otherwise be lost without a word)."""
    try:
        array.flags.writeable = False
    except (AttributeError, TypeError, ValueError):      # CuPy: no such flag
        pass


def home(p, attr: str) -> tuple[Flat, int] | None:
    """Where ``p.<attr>`` lies in a flat buffer, if it still does (an array assigned since
    lies in none)."""
    found = p.homes.get(attr)
    if found is not None and getattr(p, attr) is found[0].views[found[1]]:
        return found
    return None


def in_buffer_order(params, attr: str) -> list:
    """``params`` ordered by where their ``attr`` arrays lie: each flat buffer's in its
    order (buffers in the order first met), then those in none, as given."""
    first_seen: dict[int, int] = {}
    keys = []
    for position, p in enumerate(params):
        found = home(p, attr)
        if found is None:
            keys.append((1, 0, position))
        else:
            rank = first_seen.setdefault(id(found[0]), len(first_seen))
            keys.append((0, rank, found[1]))
    return [p for _, p in sorted(zip(keys, params), key=lambda kp: kp[0])]


def runs(params, attrs) -> list[tuple[int, int]]:
    """``params`` (in order) cut into runs ``[i, j)`` whose arrays lie one after the other in
    one flat buffer under every one of ``attrs``: each run is then one span per attr."""
    out: list[tuple[int, int]] = []
    start = 0
    for j in range(1, len(params) + 1):
        if j == len(params) or not all(_follows(params[j - 1], params[j], a) for a in attrs):
            out.append((start, j))
            start = j
    return out


def _follows(p, q, attr: str) -> bool:
    a, b = home(p, attr), home(q, attr)
    return a is not None and b is not None and a[0] is b[0] and b[1] == a[1] + 1


def span_of(params, attr: str):
    """The one 1-D view over a run's ``attr`` arrays (see ``runs``)."""
    flat, first = home(params[0], attr)
    return flat.span(first, first + len(params))


def spans(params, attr: str) -> list:
    """``params``' ``attr`` arrays in as few views as their buffers allow: a 1-D view per run
    of them, and each array in no buffer as it is (zeroing every gradient: one operation
    per buffer)."""
    ordered = in_buffer_order(params, attr)
    out = []
    for i, j in runs(ordered, [attr]):
        if home(ordered[i], attr) is None:
            out.append(getattr(ordered[i], attr))
        else:
            out.append(span_of(ordered[i:j], attr))
    return out
