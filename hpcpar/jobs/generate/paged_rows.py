"""Continuous batching's rows in a paged KV cache with automatic prefix caching
(``models.kv_blocks``, ``models.paged_kv``): one pool of blocks per stage for every
micro-batch of a replica, each row's blocks taken when it is admitted and given back when it
ends, and a prompt that begins as an earlier one did sharing that one's blocks and prefilling
only the rest.

Every stage of a replica keeps the same books (the same calls in the same order, on the
prompts every stage knows), so the stages agree on each row's blocks and on the tokens a
refill computes without a message. A row is admitted with the blocks of its prompt and of its
limit of new tokens (so no row runs out while decoding, and the pool holds what the
contiguous cache would); its prompt's full blocks are sealed (registered for later prompts)
once the stage has written their keys. The samples of a prompt refilled together share one
prefill: the first computes, the others share its full blocks and take a copy of its partial
last one (``fork``). A prompt whose leading blocks are being written by another prompt of the
same refill waits for the next refill, where it finds them cached: the requests of one system
prompt compute its keys once.

Paging serves rows whose whole output comes from their last prompt token on: a job that keeps
prompt logits or prompt log-probabilities computes every prompt position, and runs on the
contiguous cache, as do context parallelism (the cache is split over cp), CUDA graphs and a
device backend (a GPU, or the strict backend that checks a GPU's path: paging has not run on
a GPU yet).
"""

from __future__ import annotations

import numpy as np

from ...models.kv_blocks import (NO_BLOCK, BlockPool, BlockTables, PoolStats, block_hashes,
                                 blocks_for)
from ...models.paged_kv import PagedKVCache


def pages_rows(settings, prompt_ks: np.ndarray, backend, cp) -> bool:
    """Whether a continuous program keeps its rows in a paged cache (see the module):
    ``prompt_ks``, each row's prompt log-probabilities asked (-1: none)."""
    return bool(settings.prefix_cache and cp is None and not backend.on_device
                and not settings.cuda_graphs and not settings.save_logits
                and prompt_ks.max(initial=-1) < 0)


class PagedRows:
    """The pool and cache of one stage, and a view of the cache per micro-batch whose rows
    are its slots (``views``: what the program steps over)."""

    def __init__(self, stage, widths: list[int], capacity: int, block_size: int):
        self.block_size = block_size
        self.width = blocks_for(capacity, block_size)               # blocks per row, at most
        blocks = max(sum(widths) * self.width, 1)
        self.pool = BlockPool(blocks, block_size)
        self.cache = PagedKVCache(stage.ops, len(stage.decoder), blocks, stage.kv_heads,
                                  block_size, stage.cfg.head_dim, stage.dtype)
        empty = [[None] * w for w in widths]
        self.views = [self.cache.rows(self._tables(rows)) for rows in empty]
        self.cached: dict[int, int] = {}         # row -> its prompt tokens served from cache

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def release(self, row: int) -> None:
        """Row ``row`` ended (or its slot is being given away): its blocks go back."""
        if self.pool.holds(row):
            self.pool.free(row)
            self.cached.pop(row, None)

    def admit(self, waiting: list[int], prompt_ids: list[np.ndarray], limits: np.ndarray,
              source: np.ndarray, budget: int) -> int:
        """How many of the ``waiting`` rows (in order) a refill takes, each admitted with
        its blocks (a sample of a prompt the refill computes takes them at ``fork``): until
        one's leading blocks are among those the refill's rows write (it waits for them to
        be cached) or the refill's computed tokens, padded to its longest, would pass
        ``budget`` (at least one row is taken). ``source``: each row's prompt."""
        writing: set[bytes] = set()
        computing: set[int] = set()
        take, longest = 0, 0
        for row in waiting:
            if int(source[row]) in computing:             # a sample: forked after the prefill
                take += 1
                continue
            ids = prompt_ids[row]
            sharable = block_hashes(ids[:(len(ids) - 1) // self.block_size * self.block_size],
                                    b"", self.block_size)
            hits = len(self.pool.match_prefix(ids[:len(sharable) * self.block_size]))
            if any(h in writing for h in sharable[hits:hits + 1]):
                break
            computed = len(ids) - hits * self.block_size
            if take and (take + 1) * max(longest, computed) > budget:
                break
            self.cached[row] = self.pool.admit(row, ids, reserve=int(limits[row]))
            computing.add(int(source[row]))
            writing.update(sharable[hits:])
            longest = max(longest, computed)
            take += 1
        return take

    def seal(self, rows, prompt_ids: list[np.ndarray]) -> None:
        """Rows ``rows`` have their prompts' keys written: their full blocks are cached."""
        for row in rows:
            self.pool.seal(int(row), prompt_ids[int(row)])

    def fork(self, rows: np.ndarray, first: np.ndarray, inverse: np.ndarray,
             lengths: np.ndarray, limits: np.ndarray) -> None:
        """The samples among a refill's ``rows`` (those not in ``first``) start from their
        prompt's prefilled row, ``rows[first[inverse]]``: its full blocks shared, a copy of
        its partial last one (``prefill_groups`` says which is which)."""
        leaders = set(first.tolist())
        for j, row in enumerate(rows):
            if j not in leaders:
                leader = int(rows[first[inverse[j]]])
                pairs = self.pool.fork(leader, int(row), int(lengths[j]), int(limits[row]))
                self.cache.copy_blocks(pairs)
                self.cached[int(row)] = int(lengths[j])

    def bind(self, mb: int, slots: np.ndarray) -> None:
        """Micro-batch ``mb``'s view steps over the rows of its slots (``-1``: none)."""
        self.views[mb].bind(self._tables([int(r) if r >= 0 else None for r in slots]))

    def prefill_view(self, rows: np.ndarray, lengths: np.ndarray) -> PagedKVCache:
        """The cache bound to a refill's ``rows`` (prompts of ``lengths``), which write
        from their cached prefix on."""
        starts = np.array([self.cached[int(r)] for r in rows], dtype=np.int64)
        return self.cache.rows(self._tables([int(r) for r in rows]), starts, lengths)

    def starts(self, rows: np.ndarray) -> np.ndarray:
        """Each row's prompt tokens served from the cache: where its prefill starts."""
        return np.array([self.cached[int(r)] for r in rows], dtype=np.int64)

    def _tables(self, rows: list) -> BlockTables:
        """Tables of ``width`` blocks for ``rows``; None: a slot with no row (its writes and
        reads go to the null block)."""
        blocks = np.full((len(rows), self.width), NO_BLOCK, dtype=np.int32)
        frozen = np.zeros(len(rows), dtype=np.int64)
        for i, row in enumerate(rows):
            if row is not None and self.pool.holds(row):
                table = self.pool.table(row)
                blocks[i, :len(table)] = table
                frozen[i] = self.pool.frozen(row)
        return BlockTables(blocks, frozen, self.block_size)
