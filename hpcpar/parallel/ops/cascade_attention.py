"""Decode attention for rows whose keys begin with positions they share (cascade attention,
as FlashInfer's and vLLM's): the rows of a paged KV cache that took one system prompt's
cached blocks hold the same keys there, and a decode step's attention reads them once for
the group instead of once per row.

For a group of n rows sharing their first P positions, each row's query attends

    the shared keys [0, P)      all n rows' queries as one sequence of n queries against
                                one copy of the keys (one GEMM, where the rows apart are n
                                GEMVs reading the same keys n times)
    its own keys [P, length)    per row, over its own cache row

and the two partial outputs merge by their log-sum-exps (``tiled_attention.merge``): the
softmax over the union of the two key sets, the same output as attention over the whole row
up to the order of float sums. Rows in no group attend their whole row. Both parts are the
tiled attention's (``TiledAttention.attend``), so the scale and the soft cap are its own.
A sliding window, or keys split over cp, has no shared span every query sees whole: those
rows attend as usual (the caller's choice, ``applies``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .attention import AttentionRows
from .tiled_attention import TiledAttention, grouped_heads, merge

MIN_SHARED = 64            # positions: a shorter shared span is read row by row as before


@dataclass(frozen=True)
class PrefixGroups:
    """The rows of a decode step that share their first positions' keys (host facts)."""

    members: tuple            # each group's rows in the batch (int arrays, 2 rows or more)
    prefix: tuple             # each group's shared positions, from position 0
    alone: np.ndarray         # the rows in no group

    @staticmethod
    def of_tables(blocks: np.ndarray, block_size: int,
                  min_shared: int | None = None) -> "PrefixGroups | None":
        """The groups of a paged cache's rows by their block tables ``blocks`` (B, W), -1
        past a row's blocks: rows whose tables begin with the same block ids hold the same
        keys there (a block two rows hold is shared, and never written); a group's prefix
        is its rows' longest common run of leading blocks, at least ``min_shared``
        positions (default ``MIN_SHARED``). None where no two rows share that much."""
        blocks = np.asarray(blocks)
        min_shared = MIN_SHARED if min_shared is None else min_shared
        members, prefix, grouped = [], [], np.zeros(len(blocks), dtype=bool)
        first = blocks[:, 0] if blocks.size else np.zeros(0, np.int64)
        for block in np.unique(first[first >= 0]):
            rows = np.flatnonzero(first == block)
            if len(rows) < 2:
                continue
            same = (blocks[rows] == blocks[rows[0]]) & (blocks[rows[0]] >= 0)
            run = int(np.argmin(np.append(same.all(axis=0), False)))  # leading equal columns
            if run * block_size >= min_shared:
                members.append(rows)
                prefix.append(run * block_size)
                grouped[rows] = True
        if not members:
            return None
        return PrefixGroups(tuple(members), tuple(prefix), np.flatnonzero(~grouped))


def applies(rows: AttentionRows, T: int) -> bool:
    """Whether a step's attention may go by groups: one query per row (decode), every key
    on this rank, no sliding window."""
    return T == 1 and rows.window is None and rows.context is None


class CascadeAttention:
    """``forward(q, keys, values, rows, groups)``: ``ops.attention``'s decode output, (B, 1,
    heads, d), for q (B, 1, heads, d) over keys and values (B, kv_heads, S, d) whose rows
    ``groups`` says share their first positions."""

    def __init__(self, xp):
        self.xp = xp
        self.tiles = TiledAttention(xp)

    def forward(self, q, keys, values, rows: AttentionRows, groups: PrefixGroups):
        xp = self.xp
        B, T, nh, hd = q.shape
        qs, keys, values = grouped_heads(q, keys, values, rows)      # qs (B, kv, g, 1, d)
        out = xp.empty((B, T, nh, hd), dtype=q.dtype)
        parts = list(zip(groups.members, groups.prefix))
        if len(groups.alone):
            parts.append((groups.alone, 0))
        for members, shared in parts:
            at = _index(xp, members)
            own = replace(rows, q_lengths=rows.q_lengths[at], kv_lengths=rows.kv_lengths[at])
            o, lse = self.tiles.attend(qs[at], keys[at, :, shared:], values[at, :, shared:],
                                       own, k_at=shared)             # (n, kv, g, 1, d)
            if shared:
                po, plse = self._shared(qs[at], keys, values, rows, int(members[0]), shared)
                merge(xp, o, lse, po, plse)
            n = len(members)
            out[at] = o.astype(q.dtype, copy=False).transpose(0, 3, 1, 2, 4).reshape(
                n, T, nh, hd)
        return out

    def _shared(self, qs, keys, values, rows: AttentionRows, row: int, shared: int):
        """(out (n, kv, g, 1, d), lse (n, kv, g, 1)) of a group's queries ``qs`` (n, kv, g,
        1, d) against the ``shared`` positions of row ``row``'s keys, which every row of the
        group holds: the n queries as one sequence at positions shared .. shared + n - 1,
        each of which sees every one of those keys."""
        xp, n = self.xp, qs.shape[0]
        one = replace(AttentionRows.build(xp, [n], [shared + n], from_start=False),
                      softcap=rows.softcap, scale=rows.scale)
        sequence = qs[:, :, :, 0].transpose(1, 2, 0, 3)[None]        # (1, kv, g, n, d)
        po, plse = self.tiles.attend(sequence, keys[row:row + 1, :, :shared],
                                     values[row:row + 1, :, :shared], one)
        return (po[0].transpose(2, 0, 1, 3)[:, :, :, None],
                plse[0].transpose(2, 0, 1)[..., None])


def _index(xp, members: np.ndarray):
    """Rows ``members`` as a slice where they run in order (a view, no copy), else an index
    array on the device."""
    start = int(members[0])
    if np.array_equal(members, np.arange(start, start + len(members))):
        return slice(start, start + len(members))
    return xp.asarray(members)
