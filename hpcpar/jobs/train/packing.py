"""Packing (``--pack``): several samples in one row of ``--seq-len`` positions, each a document
of its own (docs/guides/training.md, "Packing").

A sample of n tokens (its ids and their labels, aligned: position t predicts ``labels[t + 1]``)
takes n - 1 positions of a row: its inputs ``ids[:-1]`` and their labels ``labels[1:]``, as it
would alone. The samples go into rows greedily, first-fit, in data order, over a window of
``WINDOW`` samples at a time: each sample goes to the first row of the window that has room,
else opens a new one; the rows are kept in the order they were opened. It reads nothing but
the samples, so every rank and every layout (any dp, pp, cp, tp) makes the same rows.

A packed row is a sample of the dataset like any other, ``(L + 1)`` ids and labels, left-padded
with -1: its inputs are ``row[:-1]`` (the documents' inputs back to back) and the labels
``labels[1:]``, so the last column is no input (it holds the last document's last token) and
the label across a boundary is no label. ``starts`` says where each position's document
begins, in the layout a batch has (real inputs first, padding after:
``data.make_batches``), for attention's mask and the rotary positions
(``parallel.ops.attention.Documents``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...parallel.errors import HpcparError

WINDOW = 1024                       # samples packed together (first-fit within the window)


class PackingError(HpcparError):
    pass


@dataclass
class PackedRows:
    """Rows of packed samples: ``samples``/``labels`` (rows, L + 1) as any dataset's (labels
    -1 where no loss), ``starts`` (rows, L) int32 each position's document start."""

    samples: np.ndarray
    labels: np.ndarray
    starts: np.ndarray
    packed: int                      # samples in the rows

    @property
    def fill(self) -> float:
        """Positions holding a sample's input over the rows' capacity."""
        used = (self.samples[:, :-1] >= 0).sum()
        return float(used) / max(self.starts.size, 1)

    def describe(self) -> str:
        rows, L = self.starts.shape
        return (f"packed {self.packed:,} samples into {rows:,} rows of {L:,} positions, "
                f"{100 * self.fill:.1f}% filled")


def first_fit(sizes: list[int], capacity: int, window: int = WINDOW) -> list[list[int]]:
    """The samples of each row (indices into ``sizes``, in data order within a row): first
    fit over windows of ``window`` samples, rows in the order they were opened."""
    rows: list[list[int]] = []
    room = np.empty(window, dtype=np.int64)      # free positions of the window's rows
    for w0 in range(0, len(sizes), window):
        members: list[list[int]] = []
        for i in range(w0, min(w0 + window, len(sizes))):
            need = sizes[i]
            fits = room[:len(members)] >= need
            r = int(fits.argmax()) if fits.any() else len(members)
            if r == len(members):
                room[r] = capacity
                members.append([])
            room[r] -= need
            members[r].append(i)
        rows += members
    return rows


def pack(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int,
         window: int = WINDOW) -> PackedRows:
    """``samples`` (ids, labels with -1 where no loss), each of 2 to seq_len + 1 tokens, in
    rows of ``seq_len`` positions."""
    L = seq_len
    rows = first_fit([len(ids) - 1 for ids, _ in samples], L, window)
    out = np.full((len(rows), L + 1), -1, dtype=np.int64)
    targets = np.full((len(rows), L + 1), -1, dtype=np.int64)
    starts = np.empty((len(rows), L), dtype=np.int32)
    for r, members in enumerate(rows):
        inputs = np.concatenate([samples[i][0][:-1] for i in members])
        labels = np.concatenate([samples[i][1][1:] for i in members])
        used = len(inputs)
        pad = L - used
        out[r, pad:L] = inputs
        out[r, L] = samples[members[-1]][0][-1]          # no input: the last token
        targets[r, pad + 1:] = labels
        at = 0
        for i in members:
            n = len(samples[i][0]) - 1
            starts[r, at:at + n] = at
            at += n
        starts[r, at:] = at                              # padding: a document of its own
    return PackedRows(out, targets, starts, len(samples))


def row_samples(samples: np.ndarray, labels: np.ndarray | None):
    """Each left-padded row of a dataset as one sample (ids, labels), its padding dropped."""
    out = []
    for r in range(len(samples)):
        row = np.asarray(samples[r])
        real = row >= 0
        first = int(real.argmax()) if real.any() else len(row)
        ids = row[first:].astype(np.int64)
        out.append((ids, ids.copy() if labels is None else np.asarray(labels[r][first:])))
    return out


def documents_of(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    """A token stream cut after each ``eos`` (the last piece may lack one)."""
    ends = np.flatnonzero(np.asarray(tokens) == eos) + 1
    pieces = np.split(np.asarray(tokens, dtype=np.int64), ends)
    return [p for p in pieces if len(p)]


def fit_documents(docs: list[np.ndarray], names: list[str], seq_len: int, long_rows: str
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, int]:
    """Plain documents (every next token learned) as samples for ``pack``: one longer than
    seq_len + 1 tokens refused (naming it) or cut, one of a single token skipped. Returns
    (samples, cut, skipped)."""
    width = seq_len + 1
    out, cut, skipped = [], 0, 0
    for ids, name in zip(docs, names):
        if len(ids) > width:
            if long_rows != "cut":
                raise PackingError(
                    f"{name}: the document has {len(ids):,} tokens, more than the {width:,} a "
                    f"row holds (--seq-len {seq_len} inputs and the label of the last); raise "
                    "--seq-len, or cut such documents with --long-rows cut")
            ids, cut = ids[:width], cut + 1
        if len(ids) < 2:
            skipped += 1
            continue
        out.append((ids, ids))
    return out, cut, skipped
