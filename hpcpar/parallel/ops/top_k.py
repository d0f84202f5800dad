"""The sampling reductions over a vocabulary split across tp ranks: each rank proposes its k
largest logits per row, the candidates of all ranks are gathered (the caller's AllGather),
and ``merge`` orders them as a single rank would have:

    local:  the k largest z of each row of this block (k = 1: the first maximum, argmax)
    merge:  candidates sorted by logit descending, ties to the lower token id

Greedy decoding is ``merge(...)[1][:, 0]``; top-k / top-p sampling draws from the merged
candidates (``hpcpar.jobs.generate.sampling``).
"""

from __future__ import annotations


class TopK:
    def __init__(self, xp):
        self.xp = xp

    def local(self, rows, k: int):
        """(values, column indices), each (N, min(k, width)), in no particular order."""
        xp = self.xp
        k = min(k, rows.shape[-1])
        if k == 1:
            idx = xp.argmax(rows, axis=-1)[:, None]            # the first maximum on ties
        else:
            idx = xp.argpartition(-rows, k - 1, axis=-1)[:, :k]
        return xp.take_along_axis(rows, idx, axis=-1), idx

    def merge(self, values, ids):
        """(values, ids) (N, c) sorted by value descending, ties by lower id."""
        xp = self.xp
        by_id = xp.argsort(ids, axis=-1)
        values, ids = xp.take_along_axis(values, by_id, -1), xp.take_along_axis(ids, by_id, -1)
        order = xp.argsort(-values, axis=-1, kind="stable")
        return xp.take_along_axis(values, order, -1), xp.take_along_axis(ids, order, -1)
