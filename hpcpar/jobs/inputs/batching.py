"""How a batch of prompts is split: over data-parallel replicas, then into micro-batches,
each padded at the end to its own longest prompt (valid tokens first, the layout fused
attention kernels take). Pure functions of the prompt lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...parallel.comm import split_sizes


@dataclass(frozen=True)
class MicroBatch:
    index: int
    rows: np.ndarray        # global prompt indices, in input order
    ids: np.ndarray         # (b, L) int64, each prompt first, then 0s
    lengths: np.ndarray     # (b,) each prompt's length

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return self.ids.shape[1]


def replica_rows(num_prompts: int, dp_size: int, dp_rank: int) -> range:
    """The contiguous block of prompts replica ``dp_rank`` generates (remainder first)."""
    sizes = split_sizes(num_prompts, dp_size)
    start = sum(sizes[:dp_rank])
    return range(start, start + sizes[dp_rank])


def micro_batches(prompts: list[np.ndarray], rows, count: int) -> list[MicroBatch]:
    """``rows`` (global prompt indices, a range or an increasing array) split into at most
    ``count`` micro-batches of consecutive entries (fewer when there are fewer rows)."""
    rows = np.asarray(rows, dtype=np.int64)
    count = min(count, len(rows))
    sizes = split_sizes(len(rows), count) if count else []
    return micro_batches_of(prompts, rows, sizes)


def micro_batches_of(prompts: list[np.ndarray], rows, sizes: list[int]) -> list[MicroBatch]:
    """``rows`` in micro-batches of consecutive entries of the given ``sizes``."""
    rows = np.asarray(rows, dtype=np.int64)
    out, start = [], 0
    for i, size in enumerate(sizes):
        chunk = rows[start:start + size]
        length = max(len(prompts[r]) for r in chunk)
        ids = np.zeros((size, length), dtype=np.int64)
        lengths = np.array([len(prompts[r]) for r in chunk], dtype=np.int64)
        for j, r in enumerate(chunk):
            ids[j, :lengths[j]] = prompts[r]
        out.append(MicroBatch(i, chunk, ids, lengths))
        start += size
    return out


def replica_order(mbs: list[MicroBatch]) -> np.ndarray:
    """The global prompt index of each of a replica's rows, micro-batch after micro-batch
    (the row order of a generation program's results)."""
    return np.concatenate([mb.rows for mb in mbs]) if mbs else np.zeros(0, np.int64)
