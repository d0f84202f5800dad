"""The vocab-parallel embedding lookup: rank i holds vocabulary rows [start, stop).

Forward: each rank looks up the ids it owns and writes zeros for the others (the caller's
AllReduce over tp sums the one non-zero contribution per token). Backward: dY scattered into
the owned rows, repeated ids summed (``GradSink.scatter_rows``), no communication.
"""

from __future__ import annotations


def embedding_lookup(xp, weight, ids, start: int, stop: int, zero_others: bool):
    """(rows of ``weight`` for the owned ids, zeros elsewhere when ``zero_others``,
    local row index of each id, which ids are owned)."""
    owned = (ids >= start) & (ids < stop)
    local = xp.where(owned, ids - start, 0)
    out = weight[local]                                      # (B, T, hidden)
    if zero_others:
        out[~owned] = 0
    return out, local, owned
