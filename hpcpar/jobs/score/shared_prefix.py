"""Rows of a scoring micro-batch that begin alike compute their common beginning once: an
evaluation's context before each of its continuations, a few-shot prompt before each
question.

The rows are grouped by a common prefix of at least ``MIN_SHARED`` tokens (consecutive rows
in sorted order: each group's prefix is what all its rows share). A first pass runs one row
per group over its prefix, into a KV cache, and scores the prefix's tokens for every row of
the group (log p(ids[t] | ids[:t]) of a token of the prefix depends on the prefix alone). A
second pass runs every row from the last token of its group's prefix on, over its group's
cached keys (copied to its own cache row), and scores the rest. The last prefix token is
computed twice so that each row's first own token is scored from its own pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_SHARED = 16            # shorter common prefixes are computed again: not worth a pass


@dataclass(frozen=True)
class SharedPrefixes:
    """How a micro-batch's rows share their beginnings."""

    leaders: np.ndarray        # (groups,) the row of each group that runs its prefix
    prefix: np.ndarray         # (groups,) each group's prefix length
    group: np.ndarray          # (rows,) each row's group, -1: none (it runs alone)

    @property
    def starts(self) -> np.ndarray:
        """(rows,) where each row's own pass starts: its group's last prefix token, or 0."""
        out = np.zeros(len(self.group), dtype=np.int64)
        held = self.group >= 0
        out[held] = self.prefix[self.group[held]] - 1
        return out


def shared_prefixes(ids: np.ndarray, lengths: np.ndarray) -> SharedPrefixes:
    """The groups of rows (``ids`` (rows, width), each row's first ``lengths`` tokens) that
    share at least ``MIN_SHARED`` leading tokens; pure and the same on every rank."""
    rows = [tuple(ids[r, :lengths[r]].tolist()) for r in range(len(lengths))]
    order = sorted(range(len(rows)), key=rows.__getitem__)
    group = np.full(len(rows), -1, dtype=np.int64)
    leaders, prefix = [], []
    i = 0
    while i < len(order):
        j, common = i + 1, len(rows[order[i]])
        while j < len(order):
            shared = _common(rows[order[i]], rows[order[j]])
            if min(shared, common) < MIN_SHARED:
                break
            common = min(common, shared)
            j += 1
        if j - i > 1:
            for r in order[i:j]:
                group[r] = len(leaders)
            leaders.append(order[i])
            prefix.append(common)
        i = j
    return SharedPrefixes(np.array(leaders, dtype=np.int64), np.array(prefix, dtype=np.int64),
                          group)


def shared_runs(rows: list[np.ndarray]) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive rows whose every neighbour shares at least
    ``MIN_SHARED`` leading tokens with it (a context and its continuations: a scoring file's
    rows in order), and the padded tokens its passes compute: its common prefix once and
    each row's rest (from the prefix's last token); a row alone is a run of its own."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or _common(tuple(rows[i - 1]), tuple(rows[i])) < MIN_SHARED:
            runs.append((start, i))
            start = i
    return runs


def run_cost(rows: list[np.ndarray]) -> int:
    """The padded tokens a run's passes compute (``shared_runs``)."""
    if len(rows) == 1:
        return len(rows[0])
    prefix = min(_common(tuple(rows[0]), tuple(r)) for r in rows[1:])
    return prefix + len(rows) * (max(len(r) for r in rows) - prefix + 1)


def _common(a: tuple, b: tuple) -> int:
    """The length of the common beginning of two rows."""
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n
