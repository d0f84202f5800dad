"""The paged KV cache (``models/kv_blocks.py``, ``models/paged_kv.py``): the block pool's books
(reference counts, chained-hash prefix matching, least-recently-released eviction, all-or-nothing
admission, statistics; a property test of random admissions and frees), and attention through
``PagedKVCache`` against attention through the contiguous ``KVCache`` holding the same keys:
a prefill from position 0, a prefill of rows that share a cached prefix and compute the rest
only, decode steps, rows of different lengths, exactly equal (float32, float64), through the
model's attention op and through tiles small enough to have edges; and cascade attention, rows
grouped by the blocks they share, against the attention over their whole rows."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpar.models.kv_cache import KVCache
from hpcpar.models.kv_blocks import (NO_BLOCK, BlockPool, BlockTables, OutOfBlocks,
                                     SharedBlockWrite, block_bytes, block_hashes, blocks_for,
                                     blocks_within, check_block_size)
from hpcpar.models.paged_kv import PagedKVCache, paged_kv_cache_bytes
from hpcpar.parallel.device.backend import select_backend
from hpcpar.parallel.errors import HpcparError
from hpcpar.parallel.ops import AttentionRows, native_ops
from hpcpar.parallel.ops.cascade_attention import CascadeAttention, PrefixGroups
from hpcpar.parallel.ops.tiled_attention import TiledAttention

LAYERS, KV, HEADS, HD, BS = 2, 2, 4, 8, 4


def the_backend():
    return select_backend(os.environ.get("HPCPAR_BACKEND", "numpy"))


# ---- planning and hashes -------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 3, -16, 24, 16.0, True])
def test_a_bad_block_size_is_one_line_that_says_what_to_pass(size):
    for make in (lambda: check_block_size(size), lambda: BlockPool(8, size),
                 lambda: PagedKVCache(native_ops(np), 1, 4, 1, size, 8, np.float32)):
        with pytest.raises(HpcparError) as e:
            make()
        message = str(e.value)
        assert "\n" not in message and "power of two" in message and repr(size) in message


def test_planning_arithmetic():
    assert [check_block_size(s) for s in (1, 2, 16, np.int64(64))] == [1, 2, 16, 64]
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    per = block_bytes(3, 2, 16, 64, 2)
    assert per == 2 * 3 * 2 * 16 * 64 * 2
    assert paged_kv_cache_bytes(3, 10, 2, 16, 64, 2) == 11 * per      # and the null block
    assert blocks_within(11 * per + per - 1, per) == 10
    assert blocks_within(per - 1, per) == 0
    cache = PagedKVCache(native_ops(np), 3, 10, 2, 16, 64, np.float16)
    assert cache.nbytes == paged_kv_cache_bytes(3, 10, 2, 16, 64, 2)


def test_block_hashes_are_chained_salted_and_the_same_in_every_process():
    ids = list(range(10))
    h = block_hashes(ids, b"", 4)
    assert len(h) == 2 and h == block_hashes(np.array(ids, np.int64), b"", 4)
    # pinned: a rank computes what every other rank, on any platform, does
    assert h[0].hex() == "1cde6d1c7a5f224a77d195fddfd6cc61"
    changed = block_hashes([99] + ids[1:], b"", 4)
    assert changed[0] != h[0] and changed[1] != h[1]     # the second block's tokens alike
    assert block_hashes(ids, "lora-1", 4)[0] != h[0]
    assert block_hashes(ids, ("model", 0), 4) == block_hashes(ids, ("model", 0), 4)
    with pytest.raises(ValueError, match="int32"):
        block_hashes([2 ** 31], b"", 4)


# ---- the pool ------------------------------------------------------------------------------

def test_a_prompt_shares_the_longest_run_of_cached_full_blocks():
    pool = BlockPool(32, block_size=4)
    a = list(range(12))
    assert pool.admit("a", a) == 0
    assert pool.seal("a", a) == 3 and pool.frozen("a") == 12
    ta = pool.table("a")
    assert pool.match_prefix(a) == ta
    # the first block alike: one block shared, the rest computed in blocks of its own
    assert pool.admit("one", a[:4] + [99] * 5) == 4
    t = pool.table("one")
    assert t[0] == ta[0] and pool.refcount(ta[0]) == 2 and not set(t[1:]) & set(ta)
    assert pool.frozen("one") == 4
    # the whole prompt cached: its last token (and so its last block) is still computed
    assert pool.admit("same", a) == 8
    assert pool.table("same")[:2] == ta[:2] and pool.table("same")[2] not in ta
    assert pool.admit("longer", a + [7]) == 12 and pool.table("longer")[:3] == ta
    # another salt (adapter), another first token, or a later block alone: nothing shared
    assert pool.match_prefix(a, "lora-1") == [] and pool.admit("lora", a, "lora-1") == 0
    assert pool.admit("first", [5] + a[1:]) == 0
    assert pool.match_prefix([99] * 4 + a[4:8]) == []
    # sealing a block whose hash is cached already registers nothing (the first stays)
    assert pool.seal("same", a) == 0 and pool.match_prefix(a) == ta
    s = pool.stats()
    assert (s.prompt_tokens, s.hit_tokens) == (12 + 9 + 12 + 13 + 12 + 12, 4 + 8 + 12)
    assert s.hit_rate == pytest.approx(24 / 70)
    assert s.in_use == s.peak_in_use == 32 - s.free - s.idle and s.idle == 0


def test_without_prefix_caching_nothing_is_shared():
    pool = BlockPool(8, block_size=4, prefix_caching=False)
    pool.admit("a", list(range(8)))
    assert pool.seal("a", list(range(8))) == 0 and pool.frozen("a") == 8
    assert pool.admit("b", list(range(9))) == 0 and pool.stats().cached == 0


def test_cached_blocks_no_row_holds_are_evicted_least_recently_released_first():
    pool = BlockPool(6, block_size=4)
    a, b = list(range(8)), list(range(100, 108))
    for row, ids in (("a", a), ("b", b)):
        pool.admit(row, ids)
        pool.seal(row, ids)
    x0, x1 = pool.table("a")
    y0, y1 = pool.table("b")
    free = [blk for blk in range(6) if blk not in (x0, x1, y0, y1)]
    pool.free("a")
    pool.free("b")                      # released last to first: x1, x0, y1, y0
    s = pool.stats()
    assert (s.free, s.idle, s.cached, s.in_use) == (2, 4, 4, 0)
    # held again and released: a's blocks are the most recently released now
    assert pool.admit("a again", a + [1]) == 8
    pool.free("a again")
    # free uncached blocks first, then y1 (a prefix's tail before its head)
    assert pool.admit("c", list(range(200, 212))) == 0
    assert sorted(pool.table("c")[:2]) == sorted(free) and pool.table("c")[2] == y1
    assert pool.match_prefix(b) == [y0] and pool.match_prefix(a) == [x0, x1]
    pool.admit("d", [1, 2, 3])
    pool.admit("e", [4, 5, 6])
    assert (pool.table("d"), pool.table("e")) == ([y0], [x1])
    assert pool.match_prefix(b) == [] and pool.match_prefix(a) == [x0]
    assert pool.stats().evictions == 3


def test_admission_is_all_or_nothing():
    pool = BlockPool(4, block_size=4)
    a = list(range(8))
    pool.admit("a", a)
    pool.seal("a", a)
    pool.free("a")                                          # 2 idle cached, 2 free
    before = pool.stats()
    with pytest.raises(OutOfBlocks) as e:                   # 2 shared + 3 fresh > 4
        pool.admit("b", a + [9] * 5, reserve=4)
    assert (e.value.needed, e.value.available) == (3, 2)
    assert pool.stats() == before and pool.rows == [] and len(pool.match_prefix(a)) == 2
    assert pool.admit("b", a + [9] * 5) == 8                # 2 shared + 2 fresh: exactly
    assert pool.stats().free == 0 and pool.available() == 0

    small = BlockPool(3, block_size=4)                      # the shared blocks are idle:
    small.admit("a", a)                                     # not evicted for their sharer
    small.seal("a", a)
    small.free("a")
    with pytest.raises(OutOfBlocks):
        small.admit("b", a + [9] * 5)
    assert small.stats().evictions == 0 and len(small.match_prefix(a)) == 2


def test_a_row_grows_block_by_block_and_a_full_pool_asks_for_preemption():
    pool = BlockPool(4, block_size=4)
    pool.admit("a", [1, 2, 3], reserve=1)
    pool.admit("b", [4, 5, 6, 7, 8])
    assert len(pool.table("a")) == 1 and len(pool.table("b")) == 2
    pool.ensure("a", 4)                                     # within its block
    pool.ensure("a", 5)
    assert len(pool.table("a")) == 2 and pool.stats().free == 0
    with pytest.raises(OutOfBlocks):
        pool.ensure("a", 9)
    assert len(pool.table("a")) == 2
    pool.free("b")                                          # preempted
    pool.ensure("a", 13)
    assert len(pool.table("a")) == 4 and pool.stats().peak_in_use == 4
    with pytest.raises(ValueError, match="free it first"):
        pool.admit("a", [1])


def test_a_forked_row_shares_full_blocks_and_copies_a_partial_one():
    pool = BlockPool(8, block_size=4)
    pool.admit("a", [1, 2, 3, 4, 5, 6], reserve=4)          # 3 blocks
    ta = pool.table("a")
    pairs = pool.fork("a", "a2", 6, reserve=2)              # positions [0, 8): 2 blocks
    t2 = pool.table("a2")
    assert len(t2) == 2 and t2[0] == ta[0] and t2[1] not in ta
    assert pairs == [(ta[1], t2[1])] and pool.refcount(ta[0]) == 2
    assert pool.frozen("a") == pool.frozen("a2") == 4       # shared: frozen in both
    assert pool.fork("a", "a3", 8) == [] and pool.table("a3") == ta[:2]
    pool.free("a")
    assert pool.refcount(ta[0]) == 2 and pool.refcount(ta[1]) == 1
    pool.free("a2")
    pool.free("a3")
    s = pool.stats()
    assert s.in_use == 0 and s.free == 8


def test_block_tables_pad_and_check_the_step():
    pool = BlockPool(8, block_size=4)
    a = list(range(8))
    pool.admit("a", a)
    pool.seal("a", a)
    pool.admit("b", a[:4] + [1, 2, 3])
    t = pool.tables(["a", "b"], width=3)
    assert t.blocks.tolist() == [pool.table("a") + [NO_BLOCK], pool.table("b") + [NO_BLOCK]]
    assert t.frozen.tolist() == [8, 4] and t.held.tolist() == [8, 8]
    t.check(starts=[8, 4], lengths=[8, 8])
    with pytest.raises(SharedBlockWrite, match="row 1 writes from position 3"):
        t.check(starts=[8, 3])
    with pytest.raises(IndexError, match="row 0 holds 9 positions"):
        t.check(lengths=[9, 7])
    with pytest.raises(ValueError):
        pool.tables(["a"], width=1)


# ---- random admissions and frees: no block lost, taken twice or shared while written ------

PROMPTS = [list(range(n)) for n in (3, 4, 8, 9, 13)] + [[50] * 8, list(range(8)) + [60] * 5]


def check_books(pool: BlockPool) -> None:
    s, bs = pool.stats(), pool.block_size
    assert s.free + s.in_use + s.idle == s.blocks and s.idle <= s.cached
    holders: dict[int, list] = {}
    for row in pool.rows:
        table = pool.table(row)
        assert len(set(table)) == len(table)
        for i, blk in enumerate(table):
            holders.setdefault(blk, []).append((row, i))
    for blk in range(s.blocks):
        assert pool.refcount(blk) == len(holders.get(blk, ()))
    assert s.in_use == len(holders)
    for held in holders.values():                # a shared block: in every holder's frozen
        if len(held) > 1:
            assert all(i < pool.frozen(row) // bs for row, i in held)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 6),
                          st.integers(0, 6), st.integers(0, 1)), max_size=40))
def test_random_admissions_and_frees_keep_the_books(actions):
    pool, bs = BlockPool(9, block_size=4), 4
    tokens: dict[int, list] = {}                 # the row's prompt, its keys all written
    written: dict[int, tuple] = {}               # block -> (salt, the tokens up to its end)
    for kind, row, which, extra, salt in actions:
        before = pool.stats()
        try:
            if kind == 0 and row not in tokens:
                ids = PROMPTS[which]
                cached = pool.admit(row, ids, salt, reserve=extra)
                assert cached % bs == 0 and cached < len(ids)
                table = pool.table(row)
                for i in range(cached // bs):    # what it shares holds its own prefix
                    assert written[table[i]] == (salt, tuple(ids[:(i + 1) * bs]))
                for i in range(cached // bs, blocks_for(len(ids), bs)):
                    written[table[i]] = (salt, tuple(ids[:(i + 1) * bs]))
                tokens[row] = ids
                if extra % 2:
                    pool.seal(row, ids)
            elif kind == 1 and row in tokens:
                pool.ensure(row, len(tokens[row]) + extra)
            elif kind == 2 and row in tokens:
                pool.seal(row, tokens[row])
            elif kind == 3 and row in tokens:
                pool.free(row)
                del tokens[row]
            elif kind == 4 and row in tokens and which not in tokens:
                for source, target in pool.fork(row, which, len(tokens[row]), extra):
                    written[target] = written[source]
                tokens[which] = tokens[row]
        except OutOfBlocks:
            assert pool.stats() == before
        check_books(pool)
    for row in list(tokens):
        pool.free(row)
    s = pool.stats()
    assert s.in_use == 0 and s.free + s.idle == s.blocks


# ---- attention through the paged cache -----------------------------------------------------

class Reference:
    """Each row's tokens, keys and values by position on the host, and attention over them
    through a contiguous ``KVCache`` holding them: what the paged cache must give."""

    def __init__(self, backend, dtype, rng):
        self.backend, self.dtype, self.rng = backend, dtype, rng
        self.ops = native_ops(backend.xp)
        self.attentions = (self.ops.attention, TiledAttention(backend.xp, block=4))
        self.tokens: dict[str, list] = {}
        self.k: dict[str, np.ndarray] = {}       # row -> (layers, positions, kv, hd)
        self.v: dict[str, np.ndarray] = {}

    def random(self, *shape):
        return self.rng.standard_normal(shape).astype(self.dtype)

    def new_row(self, row, prefix_of=None, shared=0):
        """A row with no tokens, or with the first ``shared`` of row ``prefix_of``'s (and so
        its keys: the same tokens, model and positions)."""
        self.tokens[row] = [] if prefix_of is None else self.tokens[prefix_of][:shared]
        empty = np.zeros((LAYERS, 0, KV, HD), self.dtype)
        self.k[row] = empty if prefix_of is None else self.k[prefix_of][:, :shared]
        self.v[row] = empty if prefix_of is None else self.v[prefix_of][:, :shared]

    def step(self, cache: PagedKVCache, rows, added: dict, tokens: dict):
        """Rows ``rows`` compute ``added[row]`` positions more, from their lengths: the
        keys go through ``cache`` (bound to them) and through a contiguous cache holding
        their keys so far; every output must be the same."""
        put, xp = self.backend.asarray, self.backend.xp
        starts = np.array([len(self.tokens[r]) for r in rows])
        q_lengths = np.array([added[r] for r in rows])
        B, T = len(rows), int(q_lengths.max())
        k, v = self.random(LAYERS, B, T, KV, HD), self.random(LAYERS, B, T, KV, HD)
        q = self.random(LAYERS, B, T, HEADS, HD)
        attention_rows = AttentionRows.build(xp, q_lengths, starts + q_lengths,
                                             from_start=not starts.any())
        reference = KVCache(self.ops, LAYERS, B, KV, int((starts + T).max()), HD, self.dtype)
        for b, r in enumerate(rows):
            for held, new in ((reference.k, self.k), (reference.v, self.v)):
                held[:, b, :, :starts[b]] = put(new[r].transpose(0, 2, 1, 3))
        for layer in range(LAYERS):
            args = (attention_rows.cache_slots(), attention_rows.from_start,
                    attention_rows.max_kv)
            got = cache.write(layer, put(k[layer]), put(v[layer]), *args)
            want = reference.write(layer, put(k[layer]), put(v[layer]), *args)
            assert got[0].shape[2] >= attention_rows.max_kv
            for op in self.attentions:
                outs = [self.backend.to_host(op.forward(put(q[layer]), *kv, attention_rows))
                        for kv in (got, want)]
                np.testing.assert_array_equal(outs[0], outs[1])
        for b, r in enumerate(rows):
            n = q_lengths[b]
            self.k[r] = np.concatenate([self.k[r], k[:, b, :n]], axis=1)
            self.v[r] = np.concatenate([self.v[r], v[:, b, :n]], axis=1)
            self.tokens[r] = self.tokens[r] + tokens[r]


@pytest.mark.device
@pytest.mark.parametrize("width, decode", [(None, "gathered"), (8, "gathered"),
                                           (8, "contiguous")],
                         ids=["longest", "fixed", "contiguous-view"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_attention_through_the_paged_cache_is_the_contiguous_caches(dtype, width, decode):
    """Decode steps read the blocks gathered each step, or through a ``contiguous`` view that
    keeps its rows in position order (made before the decode, bound again at each step)."""
    backend = the_backend()
    rng = np.random.default_rng(7)
    ref = Reference(backend, dtype, rng)
    pool = BlockPool(24, block_size=BS)
    cache = PagedKVCache(ref.ops, LAYERS, 24, KV, BS, HD, dtype)
    for held in (cache.k, cache.v):          # unwritten positions hold old, finite values
        held[...] = backend.asarray(ref.random(*held.shape))

    def prefill(rows, prompts, salts):
        for r in rows:
            cached = pool.admit(r, prompts[r], salts.get(r, b""))
            assert cached == len(ref.tokens[r])
        tables = pool.tables(rows, width)
        starts = [len(ref.tokens[r]) for r in rows]
        step = cache.rows(tables, starts, [len(prompts[r]) for r in rows])
        ref.step(step, rows, {r: len(prompts[r]) - len(ref.tokens[r]) for r in rows},
                 {r: prompts[r][len(ref.tokens[r]):] for r in rows})
        for r in rows:
            pool.seal(r, ref.tokens[r])

    a, b = [int(t) for t in rng.integers(0, 1000, 10)], [1, 2, 3, 4, 5]
    for r in ("a", "b"):
        ref.new_row(r)
    prefill(["a", "b"], {"a": a, "b": b}, {})                 # from position 0
    ref.new_row("c", "a", 8)                                  # two blocks of a's
    ref.new_row("d", "a", 4)                                  # one block of a's
    ref.new_row("e")                                          # a's tokens, another adapter
    prompts = {"c": a[:8] + [7, 8, 9, 10], "d": a[:4] + [11, 12, 13], "e": a[:9]}
    prefill(["c", "d", "e"], prompts, {"e": "adapter-2"})     # each from its own start
    assert pool.table("c")[:2] == pool.table("a")[:2]
    assert pool.table("d")[0] == pool.table("a")[0]
    rows = ["a", "b", "c", "d", "e"]
    view = (cache.rows(pool.tables(rows, width)).contiguous() if decode == "contiguous"
            else cache)
    for _ in range(6):                                        # decode: a block fills up
        for r in rows:
            pool.ensure(r, len(ref.tokens[r]) + 1)
        view.bind(pool.tables(rows, width), [len(ref.tokens[r]) for r in rows])
        ref.step(view, rows, dict.fromkeys(rows, 1),
                 {r: [int(rng.integers(1000))] for r in rows})
        for r in rows:
            pool.seal(r, ref.tokens[r])
    s = pool.stats()
    assert (s.prompt_tokens, s.hit_tokens) == (10 + 5 + 12 + 7 + 9, 8 + 4)


@pytest.mark.device
def test_a_shared_block_is_never_written():
    backend = the_backend()
    xp, host = backend.xp, backend.to_host
    pool = BlockPool(8, block_size=BS)
    cache = PagedKVCache(native_ops(xp), 1, 8, KV, BS, HD, np.float32)
    a = list(range(8))
    pool.admit("a", a)
    pool.seal("a", a)
    assert pool.admit("b", a[:4] + [1, 2, 3]) == 4
    tables = pool.tables(["b"])
    with pytest.raises(SharedBlockWrite):
        cache.bind(tables, starts=[3])
    with pytest.raises(IndexError, match="ensure"):
        cache.bind(tables, lengths=[9])
    cache.bind(tables)
    # positions 2..9: 2, 3 in the shared block and 8, 9 past the row's blocks go to the
    # null block; 4..7 to the row's own second block
    block, offset = (host(x) for x in cache.slots(xp.asarray(np.array([2], np.int32)), 8))
    own = pool.table("b")[1]
    assert block.tolist() == [[8, 8, own, own, own, own, 8, 8]]
    assert offset.tolist() == [[2, 3, 0, 1, 2, 3, 0, 1]]
    k = xp.ones((1, 8, KV, HD), dtype=np.float32)
    if not backend.on_device:              # on the host, write checks the starts itself
        with pytest.raises(SharedBlockWrite):
            cache.write(0, k, k, np.array([2], np.int32), False, 8)
    keys, _ = cache.write(0, k, k, xp.asarray(np.array([4], np.int32)), False, 8)
    stored = host(cache.k)
    assert not stored[0, pool.table("a")].any()              # a's blocks untouched
    assert (stored[0, own] == 1).all() and host(keys)[0, :, 4:].all()


@pytest.mark.device
def test_a_forked_row_reads_its_parents_keys_and_writes_its_own():
    backend = the_backend()
    xp, host = backend.xp, backend.to_host
    rng = np.random.default_rng(3)
    pool = BlockPool(8, block_size=BS)
    cache = PagedKVCache(native_ops(xp), 1, 8, KV, BS, HD, np.float64)
    pool.admit("a", [1, 2, 3, 4, 5, 6], reserve=2)
    cache.bind(pool.tables(["a"]))
    k = rng.standard_normal((1, 6, KV, HD))
    cache.write(0, xp.asarray(k), xp.asarray(k), xp.asarray(np.zeros(1, np.int32)), True, 6)
    cache.copy_blocks(pool.fork("a", "a2", 6, reserve=2))
    both = pool.tables(["a", "a2"])
    cache.bind(both, starts=[6, 6])
    new = rng.standard_normal((2, 1, KV, HD))
    keys, _ = cache.write(0, xp.asarray(new), xp.asarray(new), xp.asarray(np.full(2, 6)),
                          False, 7)
    keys = host(keys)                                       # (2, kv, 8, hd)
    for b in range(2):
        np.testing.assert_array_equal(keys[b, :, :6], k[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(keys[b, :, 6], new[b, 0])
    view = cache.rows(pool.tables(["a2"]))
    assert cache.tables is both and view.capacity == 8 and view.k is cache.k


@pytest.mark.device
def test_a_step_needs_tables_of_its_rows_and_positions():
    backend = the_backend()
    xp = backend.xp
    cache = PagedKVCache(native_ops(xp), 1, 4, KV, BS, HD, np.float32)
    k = xp.zeros((2, 1, KV, HD), dtype=np.float32)
    starts = xp.asarray(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="bind the step's block tables"):
        cache.write(0, k, k, starts, False, 1)
    cache.bind(BlockTables(np.array([[0], [1]], np.int32), np.zeros(2, np.int64), BS))
    with pytest.raises(IndexError, match="hold 4 positions, step needs 5"):
        cache.write(0, k, k, starts, False, 5)
    with pytest.raises(ValueError, match="block tables"):
        cache.bind(BlockTables(np.array([[4]], np.int32), np.zeros(1, np.int64), BS))


# ---- cascade attention: a group's shared keys read once -------------------------------------

def test_rows_whose_tables_begin_alike_are_grouped_by_their_common_run():
    blocks = np.array([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 1, 2], [3, 4, -1, -1],
                       [-1, -1, -1, -1], [3, 4, 0, -1]])
    groups = PrefixGroups.of_tables(blocks, 16, min_shared=32)
    assert [g.tolist() for g in groups.members] == [[3, 5], [0, 1, 2]]
    assert groups.prefix == (32, 32) and groups.alone.tolist() == [4]
    assert PrefixGroups.of_tables(blocks, 16, min_shared=48) is None
    assert PrefixGroups.of_tables(blocks[:2], 16, min_shared=48).prefix == (48,)


@pytest.mark.device
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "soft-capped"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_cascade_attention_is_the_attention_over_the_whole_rows(dtype, softcap):
    """Rows 0-3 share 96 positions (in order: a view), rows 4 and 6 share 64 (apart: an
    index), row 5 is alone; a decode step's output against the reference's over every row's
    whole keys, with the scores' own scale and soft cap."""
    backend = the_backend()
    xp = backend.xp
    rng = np.random.default_rng(3)
    B, C = 7, 200
    keys, values = (rng.standard_normal((B, KV, C, HD)).astype(dtype) for _ in range(2))
    for source, copies, shared in ((0, [1, 2, 3], 96), (4, [6], 64)):
        keys[copies, :, :shared] = keys[source, :, :shared]
        values[copies, :, :shared] = values[source, :, :shared]
    q = rng.standard_normal((B, 1, HEADS, HD)).astype(dtype)
    lengths = np.array([150, 97, 130, 180, 70, 33, 65])
    rows = AttentionRows.build(xp, np.ones(B), lengths, from_start=False)
    rows = AttentionRows(rows.q_lengths, rows.kv_lengths, rows.max_kv, False, scale=0.3,
                         softcap=softcap)
    groups = PrefixGroups((np.array([0, 1, 2, 3]), np.array([4, 6])), (96, 64), np.array([5]))
    q_, keys_, values_ = (xp.asarray(a) for a in (q, keys, values))
    got = backend.to_host(CascadeAttention(xp).forward(q_, keys_, values_, rows, groups))
    want = backend.to_host(native_ops(xp).attention.forward(q_, keys_, values_, rows))
    np.testing.assert_allclose(got, want, atol=1e-6 if dtype == np.float32 else 1e-12)
