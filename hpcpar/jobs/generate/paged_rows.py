"""Continuous batching's rows in a paged KV cache with automatic prefix caching
(``models.kv_blocks``, ``models.paged_kv``): one pool of blocks per stage for every
micro-batch of a replica, each row's blocks taken when it is admitted and given back when it
ends, and a prompt that begins as an earlier one did sharing that one's blocks and prefilling
only the rest.

Every stage of a replica keeps the same books (the same calls in the same order, on the
prompts every stage knows), so the stages agree on each row's blocks and on the tokens a
refill computes without a message. A row is admitted with the blocks of its prompt and of a
segment's new tokens, when the pool has them, and takes the blocks of the next segment before
each one starts; where the pool runs out, the newest rows are preempted (their blocks freed)
and wait to compute their prompt and tokens again (``grow``). The pool holds ``--kv-memory``
(``kv_pool_blocks``), at most what every row would hold at its end. A prompt's full blocks
are sealed (registered for later prompts) once the stage has written their keys. The samples of a prompt refilled together share one
prefill: the first computes, the others share its full blocks and take a copy of its partial
last one (``fork``). A prompt whose leading blocks are being written by another prompt of the
same refill waits for the next refill, where it finds them cached: the requests of one system
prompt compute its keys once.

Paging serves rows whose whole output comes from their last prompt token on: a job that keeps
prompt logits or prompt log-probabilities computes every prompt position, and runs on the
contiguous cache, as do static batching, context parallelism (the cache is split over cp),
CUDA graphs and a device backend (a GPU, or the strict backend that checks a GPU's path),
where paging has not run yet: ``HPCPAR_PAGED_DEVICE=1`` turns it on there (a gather of each
row's blocks before the existing attention kernel). ``--prefix-cache`` asks for it
explicitly, and is refused in one line where it cannot serve (``paging_refusal``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...models.kv_blocks import (NO_BLOCK, BlockPool, BlockTables, OutOfBlocks, PoolStats,
                                 block_bytes, block_hashes, blocks_for)
from ...models.paged_kv import PagedKVCache
from ...parallel.environment import environment_value
from ...parallel.errors import HpcparError
from ..launch import everyone
from .results import ResultShape

KV_SHARE = 0.5             # the share of a rank's free memory the KV cache gets by default


def kv_memory_budget(wanted: float, free: float | None) -> float | None:
    """The KV cache's bytes on a rank, paged or contiguous: ``--kv-memory`` ``wanted``
    (bytes above 1, else a fraction of the ``free`` memory, 0 for ``KV_SHARE``); None where
    the free memory is not known and no bytes were given."""
    if wanted > 1:
        return wanted
    return None if free is None else (wanted or KV_SHARE) * free


def kv_pool_blocks(settings, stage, mbs, limits, backend, world, comm) -> int:
    """The blocks of each stage's paged KV cache (collective over the world): what
    ``--kv-memory`` gives every rank (a fraction of its free memory up to 1, bytes above it;
    by default ``KV_SHARE`` of it), in blocks of this stage's layers, the fewest over the
    ranks. A pool that cannot hold the longest row of any replica (its prompt and its new
    tokens), or ``--kv-memory`` beyond a rank's free memory, is refused on every rank of
    ``comm`` (the world's MPI communicator)."""
    k_dim, v_dim = stage.kv_dims           # (latent attention's: its latent, no values)
    per = block_bytes(len(stage.decoder), stage.kv_heads, settings.kv_block_size, k_dim,
                      np.dtype(stage.dtype).itemsize, v_dim)
    free = backend.free_memory_bytes()
    wanted = settings.kv_memory
    problem = None
    if wanted > 1 and free is not None and wanted > free:
        problem = (f"--kv-memory {wanted:.4g} bytes is more than this rank's free memory, "
                   f"{free:.4g} bytes: give less, or a fraction of it (0.5: half)")
    budget = kv_memory_budget(wanted, free)
    budget = 2 ** 62 if budget is None else budget
    longest = max((blocks_for(int(n) + int(limits[r]), settings.kv_block_size)
                   for mb in mbs for r, n in zip(mb.rows, mb.lengths)), default=0)
    agreed = world.all_reduce(np.array([-int(budget // max(per, 1)), longest, problem is not None],
                                       dtype=np.int64), op="max")
    blocks, longest = -int(agreed[0]), int(agreed[1])

    def check():
        if problem is not None:
            raise HpcparError(problem)
        if agreed[2] == 0 and blocks < longest:
            raise HpcparError(
                f"the KV cache holds {blocks} blocks of {settings.kv_block_size} positions on "
                f"the fullest rank, and the longest row needs {longest} (its prompt and its "
                f"new tokens): give --kv-memory more (now "
                f"{'the default share' if not wanted else f'{wanted:.4g}'}), or generate "
                f"fewer tokens")
    everyone(comm, check)
    return blocks


def paging_refusal(settings, prompt_logprobs: bool, cp: int,
                   on_device: bool | None) -> str | None:
    """Why a job's rows cannot go in a paged cache with prefix caching, exactly as they run in
    a contiguous one (see the module), or None where they can: ``prompt_logprobs``, whether
    a row keeps them; ``cp``, the context-parallel ranks; ``on_device``, whether the backend
    is a device's (None: not known yet)."""
    if settings.batching == "static":
        return ("static batching runs each micro-batch in a KV cache of its own; the paged "
                "cache is continuous batching's (the default): drop --batching static")
    if cp > 1:
        return (f"the KV cache is split over cp {cp}, position by position, and a block of "
                "the paged cache holds consecutive positions: run without --cp")
    if settings.save_logits or prompt_logprobs:
        return ("prompt logits and prompt log-probabilities are computed at every prompt "
                "position, so no prompt begins from cached keys: drop --save-logits / "
                "--prompt-logprobs")
    if settings.cuda_graphs:
        return ("a CUDA graph replays a decode step over fixed rows of a contiguous cache: "
                "drop --cuda-graphs")
    if on_device and environment_value("HPCPAR_PAGED_DEVICE") != "1":
        return ("the paged cache on a device has not run on a GPU yet: set "
                "HPCPAR_PAGED_DEVICE=1 to use it there")
    return None


def check_prefix_cache(settings, results: ResultShape, cp: int,
                       on_device: bool | None = None) -> None:
    """``--prefix-cache`` asked for where it cannot serve: one line saying why (by default
    the job runs in a contiguous cache instead)."""
    reason = settings.prefix_cache and paging_refusal(
        settings, results.prompt_logprobs >= 0, cp, on_device)
    if reason:
        raise HpcparError(f"--prefix-cache: {reason}")


def pages_rows(settings, results: ResultShape, backend, cp) -> bool:
    """Whether the rows go in a paged cache: unless ``--no-prefix-cache``, wherever
    ``paging_refusal`` has no reason (``cp``: the context-parallel group, or None)."""
    return (settings.prefix_cache is not False
            and paging_refusal(settings, results.prompt_logprobs >= 0,
                               1 if cp is None else cp.size, backend.on_device) is None)


class PagedRows:
    """The pool and cache of one stage, and a view of the cache per micro-batch whose rows
    are its slots (``views``: what the program steps over). Rows are the program's (replica)
    row indices; ``ids(row)`` is what a row's refill computes from: its prompt, and the
    tokens it had generated when it was preempted."""

    def __init__(self, stage, widths: list[int], capacity: int, block_size: int,
                 blocks: int, earlier: "PagedRows | None" = None):
        """``blocks``: the pool's; an ``earlier`` wave's pool and cache are kept where they
        hold as many blocks of this size (its rows given back, its cached prompts kept for
        this wave's)."""
        self.block_size = block_size
        self.width = blocks_for(capacity, block_size)               # blocks per row, at most
        if (earlier is not None and earlier.block_size == block_size
                and earlier.pool.num_blocks >= blocks):
            self.pool, self.cache = earlier.pool, earlier.cache
            for row in self.pool.rows:
                self.pool.free(row)
        else:
            self.pool = BlockPool(blocks, block_size)
            k_dim, v_dim = stage.kv_dims
            self.cache = PagedKVCache(stage.ops, len(stage.decoder), blocks, stage.kv_heads,
                                      block_size, k_dim, stage.dtype, v_dim)
        self.start = self.pool.stats()           # the pool's counts before this wave
        empty = [[None] * w for w in widths]
        # each micro-batch's rows also kept in position order: its decode steps read them
        # without gathering every block each step
        self.views = [self.cache.rows(self._tables(rows)).contiguous() for rows in empty]
        self.cached: dict[int, int] = {}         # row -> its prompt tokens served from cache
        self.order: dict[int, int] = {}          # row -> when it was admitted (preempt last)
        self.admitted = 0
        # row -> the blocks a refill's sample forks into at its prefill: kept until then,
        # whichever micro-batches refill in between
        self.promises: dict[int, int] = {}
        self.preemptions = 0

    @property
    def promised(self) -> int:
        """The blocks admitted samples fork into at their prefills, not taken yet."""
        return sum(self.promises.values())

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + sum(view.rows_nbytes for view in self.views)

    def stats(self) -> PoolStats:
        """The pool's counts of this wave's prompts (its blocks, and its peak in use over the
        run)."""
        now = self.pool.stats()
        return replace(now, prompt_tokens=now.prompt_tokens - self.start.prompt_tokens,
                       hit_tokens=now.hit_tokens - self.start.hit_tokens,
                       evictions=now.evictions - self.start.evictions)

    def release(self, row: int) -> None:
        """Row ``row`` ended (or was preempted): its blocks go back."""
        if self.pool.holds(row):
            self.pool.free(row)
        self.cached.pop(row, None)
        self.order.pop(row, None)

    def grow(self, needs: dict[int, int]) -> list[int]:
        """Every row of ``needs`` (row -> positions it must hold), oldest first, takes the
        blocks it lacks; where the pool runs out, the newest rows are preempted (their blocks
        freed) until it does not. Returns the rows preempted, which compute their tokens
        again when readmitted (vLLM's recompute)."""
        preempted = []
        for row in sorted(needs, key=self.order.__getitem__):
            while self.pool.holds(row):
                try:
                    self.pool.ensure(row, needs[row])
                    break
                except OutOfBlocks:
                    newest = max((r for r in needs if self.pool.holds(r)),
                                 key=self.order.__getitem__)
                    self.release(newest)
                    preempted.append(newest)
                    self.preemptions += 1
        return preempted

    def extend(self, needs: dict[int, int]) -> bool:
        """Whether every row of ``needs`` holds its positions, each taking the blocks it
        lacks while the pool has them (none preempted)."""
        try:
            for row in sorted(needs, key=self.order.__getitem__):
                self.pool.ensure(row, needs[row])
        except OutOfBlocks:
            return False
        return True

    def admit(self, waiting: list[int], ids, key, reserve, budget: int) -> int:
        """How many of the ``waiting`` rows (in order) a refill takes, each admitted with the
        blocks of ``ids(row)`` and ``reserve(row)`` positions more; a row whose ``key(row)``
        (its prompt, where a fresh sample of it) is a row's of the refill forks that row's
        blocks after the prefill, whose fresh blocks are kept for it. The refill stops at the
        first row the pool cannot hold, one whose leading blocks are among those the refill's
        rows write (it waits for them to be cached), or one that would make the refill's
        computed tokens, padded to its longest, pass ``budget`` (at least one row is taken
        where the pool holds it)."""
        writing: set[bytes] = set()
        computing: set = set()
        take, longest = 0, 0
        for row in waiting:
            tokens = ids(row)
            prompt = key(row)
            if prompt is not None and prompt in computing:      # forked after the prefill
                more = (blocks_for(len(tokens) + reserve(row), self.block_size)
                        - len(tokens) // self.block_size)
                if self.pool.available() - self.promised < more:
                    break
                self.promises[row] = more
                self._admitted(row)
                take += 1
                continue
            bs = self.block_size
            sharable = block_hashes(tokens[:(len(tokens) - 1) // bs * bs], b"", bs)
            hits = len(self.pool.cache.match(sharable))
            if any(h in writing for h in sharable[hits:hits + 1]):
                break
            computed = len(tokens) - hits * bs
            if take and (take + 1) * max(longest, computed) > budget:
                break
            # the shared blocks may be idle ones, which count as available (exact when no
            # row runs, so a refill of an idle pool never waits for nothing)
            fresh = blocks_for(len(tokens) + reserve(row), bs) - hits
            if fresh + self.promised > self.pool.available() - hits:
                break
            try:
                self.cached[row] = self.pool.admit(row, tokens, reserve=reserve(row))
            except OutOfBlocks:
                break
            self._admitted(row)
            if prompt is not None:
                computing.add(prompt)
            writing.update(sharable[hits:])
            longest = max(longest, computed)
            take += 1
        return take

    def _admitted(self, row: int) -> None:
        self.order[row] = self.admitted
        self.admitted += 1

    def seal(self, rows, ids) -> None:
        """Rows ``rows`` have the keys of ``ids(row)`` written: their full blocks are cached."""
        for row in rows:
            self.pool.seal(int(row), ids(int(row)))

    def fork(self, rows: np.ndarray, first: np.ndarray, inverse: np.ndarray,
             lengths: np.ndarray, reserve) -> None:
        """The samples among a refill's ``rows`` (those not in ``first``) start from their
        prompt's prefilled row, ``rows[first[inverse]]``: its full blocks shared, a copy of
        its partial last one, and ``reserve(row)`` positions more (``prefill_groups`` says
        which is which; ``admit`` kept their blocks)."""
        leaders = set(first.tolist())
        for j, row in enumerate(rows):
            if j not in leaders:
                leader = int(rows[first[inverse[j]]])
                self.promises.pop(int(row), None)          # taken now
                pairs = self.pool.fork(leader, int(row), int(lengths[j]), reserve(int(row)))
                self.cache.copy_blocks(pairs)
                self.cached[int(row)] = int(lengths[j])

    def bind(self, mb: int, slots: np.ndarray, refresh=()) -> None:
        """Micro-batch ``mb``'s view steps over the rows of its slots (``-1``: none); the
        slots ``refresh`` were written through another view (a refill's prefill)."""
        self.views[mb].bind(self._tables([int(r) if r >= 0 else None for r in slots]),
                            refresh=refresh)

    def prefill_view(self, rows: np.ndarray, lengths: np.ndarray) -> PagedKVCache:
        """The cache bound to a refill's ``rows`` (prompts of ``lengths``), which write
        from their cached prefix on."""
        return self.cache.rows(self._tables([int(r) for r in rows]), self.starts(rows),
                               lengths)

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
