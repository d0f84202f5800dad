"""The books of a KV cache in blocks (vLLM's paged attention and automatic prefix caching):
which blocks each row holds, which rows share them, and which blocks stay cached for rows to
come. Pure Python and NumPy, no keys: the arrays are ``paged_kv.PagedKVCache``'s.

A stage's keys and values live in ``num_blocks`` blocks of ``block_size`` positions each. A row
holds a list of blocks, its block table: position p of the row sits in block
table[p // block_size] at offset p % block_size. Rows take blocks as they grow, so the memory
goes to the tokens rows hold, not to each row's longest possible length (``KVCache``'s
capacity).

``BlockPool`` keeps the books, the same on every rank: the free blocks, a reference count per
block and each row's table. A full block is known by a hash chained over every token up to its
end and a salt (whatever else changes its keys: the model or adapter, a position offset):
blake2b over the tokens' int32 bytes, which every rank computes alike. Once a full block's keys
are written, ``seal`` registers it under its hash (``PrefixCache``); a new prompt shares the
longest run of its full blocks whose hashes are registered (``admit``: reference count + 1,
never written again) and computes the rest only. Its last token is always computed, for its
logits: a prompt of L tokens shares at most the full blocks of its first L - 1, as vLLM does.
A registered block that no row holds stays cached until a block is needed: free uncached
blocks go first, then cached ones, least recently released first (a row releases its blocks
last to first, so the tail of a prefix goes before its head).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..parallel.errors import HpcparError

BLOCK_SIZE = 16                 # positions per block by default (vLLM's)
NO_BLOCK = -1                   # a table's entry past a row's blocks
ROOT = bytes(16)                # the parent hash of a sequence's first block


# ---- planning ------------------------------------------------------------------------------

def check_block_size(block_size) -> int:
    """``block_size`` itself, a positive power of two (positions p // block_size and
    p % block_size are a shift and a mask); anything else is a one-line ``HpcparError``."""
    if (isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool)
            and block_size > 0 and block_size & (block_size - 1) == 0):
        return int(block_size)
    raise HpcparError(f"KV-cache block size {block_size!r}: pass a positive power of two "
                      f"(16, the default, or 8, 32, 64, ...)")


def blocks_for(length: int, block_size: int) -> int:
    """The blocks ``length`` positions take."""
    return -(-int(length) // block_size)


def block_bytes(num_layers: int, kv_heads: int, block_size: int, head_dim: int,
                itemsize: int, v_dim: int | None = None) -> int:
    """The bytes one block takes on a stage: its keys and values in every layer (values of
    ``v_dim`` where given: latent attention's 0)."""
    dims = head_dim + (head_dim if v_dim is None else v_dim)
    return num_layers * kv_heads * block_size * dims * itemsize


def blocks_within(nbytes: int, per_block: int) -> int:
    """The blocks a ``PagedKVCache`` of at most ``nbytes`` holds, beside its null block."""
    return max(0, nbytes // per_block - 1)


# ---- hashes --------------------------------------------------------------------------------

def salt_bytes(salt) -> bytes:
    """The salt as bytes: bytes as they are, anything else its repr (a str, an int, a tuple of
    them: the same in every process)."""
    return salt if isinstance(salt, bytes) else repr(salt).encode("utf-8")


def token_array(token_ids) -> np.ndarray:
    """Token ids as little-endian int32, refusing what int32 cannot hold."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= 2 ** 31)):
        raise ValueError(f"token ids must be a 1-D run of non-negative int32 values, not "
                         f"shape {ids.shape}")
    return ids.astype("<i4")


def block_hash(parent: bytes, tokens: np.ndarray, salt: bytes) -> bytes:
    """The hash of a full block: its parent's hash, the salt (its length first), its tokens'
    int32 bytes."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(salt).to_bytes(8, "little"))
    h.update(salt)
    h.update(tokens.tobytes())
    return h.digest()


def block_hashes(token_ids, salt, block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The chained hash of each full block of ``token_ids`` (a partial last block has none)."""
    ids, salt = token_array(token_ids), salt_bytes(salt)
    out = []
    for i in range(len(ids) // block_size):
        parent = block_hash(parent, ids[i * block_size:(i + 1) * block_size], salt)
        out.append(parent)
    return out


# ---- the books -----------------------------------------------------------------------------

class OutOfBlocks(Exception):
    """The pool cannot give a row the blocks it asks for (nothing was taken): the caller
    preempts a row (``BlockPool.free``) and asks again, or waits."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"{needed} KV-cache blocks needed, {available} available")
        self.needed, self.available = needed, available


class SharedBlockWrite(RuntimeError):
    """A step would write positions of a row's frozen prefix: blocks other rows may share."""


class PrefixCache:
    """Full blocks by hash: the registered ones, and among them those no row holds (idle), in
    the order they became idle; the least recently idle goes first when a block is needed."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.hash_of)

    def register(self, block: int, h: bytes) -> bool:
        """Block ``block`` holds the keys of hash ``h``; False when another block already
        does (this one stays unregistered, as vLLM keeps the first)."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h], self.hash_of[block] = block, h
        return True

    def match(self, hashes) -> list[int]:
        """The blocks of the longest run of ``hashes`` (an iterable, read lazily) from the
        first that are registered."""
        out = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def release(self, block: int) -> None:
        """No row holds registered block ``block`` now: it is the most recently idle."""
        self.idle[block] = None

    def hold(self, block: int) -> None:
        """A row holds block ``block`` again (it is idle no longer)."""
        self.idle.pop(block, None)

    def evict(self) -> int:
        """The least recently idle block, its hash forgotten."""
        block, _ = self.idle.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        return block


@dataclass(frozen=True)
class PoolStats:
    """A ``BlockPool``'s counts: free + in_use + idle == blocks at every moment."""

    blocks: int               # the pool's blocks
    free: int                 # held by no row and registered under no hash
    in_use: int               # held by some row (reference count > 0)
    cached: int               # registered under a hash (held or idle)
    idle: int                 # registered, held by no row: evicted when blocks are needed
    peak_in_use: int
    prompt_tokens: int        # of the prompts admitted
    hit_tokens: int           # of those, served from the cache (their keys not computed)
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Row:
    blocks: list[int]
    salt: bytes
    hashes: list[bytes] = field(default_factory=list)    # of its sealed leading blocks
    frozen: int = 0                                      # leading blocks never written again


@dataclass(frozen=True)
class BlockTables:
    """The block tables of one step's rows, on the host: what ``PagedKVCache.bind`` takes."""

    blocks: np.ndarray        # (B, W) int32 block ids, NO_BLOCK past a row's blocks
    frozen: np.ndarray        # (B,) int64: positions [0, frozen[b]) are never written
    block_size: int

    @property
    def held(self) -> np.ndarray:
        """(B,) the positions each row's blocks hold."""
        return (self.blocks >= 0).sum(axis=1) * self.block_size

    def check(self, starts=None, lengths=None) -> None:
        """Refuse a step whose row b writes from position ``starts[b]`` into its frozen
        prefix (``SharedBlockWrite``), or holds ``lengths[b]`` positions where its blocks
        hold fewer (IndexError); host integers (B,)."""
        if starts is not None:
            starts = np.asarray(starts)
            bad = np.flatnonzero(starts < self.frozen)
            if len(bad):
                b = int(bad[0])
                raise SharedBlockWrite(f"row {b} writes from position {int(starts[b])}, in "
                                       f"its first {int(self.frozen[b])} (shared or sealed)")
        if lengths is not None:
            lengths = np.asarray(lengths)
            bad = np.flatnonzero(lengths > self.held)
            if len(bad):
                b = int(bad[0])
                raise IndexError(f"row {b} holds {int(lengths[b])} positions, its blocks "
                                 f"{int(self.held[b])}: ensure() it first")


class BlockPool:
    """The blocks of a paged KV cache: who holds which, and which hold a cached prefix."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE,
                 prefix_caching: bool = True):
        self.block_size = check_block_size(block_size)
        if not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
            raise HpcparError(f"KV-cache blocks {num_blocks!r}: pass a positive number")
        self.num_blocks, self.prefix_caching = int(num_blocks), prefix_caching
        self.cache = PrefixCache()
        self._free = list(range(self.num_blocks - 1, -1, -1))   # taken from the end
        self._refs = [0] * self.num_blocks
        self._rows: dict[object, _Row] = {}
        self._in_use = self._peak = self._prompt = self._hits = self._evictions = 0

    # ---- queries ---------------------------------------------------------------------------

    def available(self) -> int:
        """The blocks a request can take now: free ones and idle cached ones."""
        return len(self._free) + len(self.cache.idle)

    def table(self, row) -> list[int]:
        """Row ``row``'s blocks, in position order."""
        return list(self._rows[row].blocks)

    def frozen(self, row) -> int:
        """The positions of row ``row`` in shared or sealed blocks: never written again."""
        return self._rows[row].frozen * self.block_size

    def refcount(self, block: int) -> int:
        return self._refs[block]

    @property
    def rows(self) -> list:
        return list(self._rows)

    def holds(self, row) -> bool:
        """Whether row ``row`` holds blocks."""
        return row in self._rows

    def match_prefix(self, token_ids, salt=b"") -> list[int]:
        """The cached blocks a sequence starting with ``token_ids`` can share: those of the
        longest run of its full blocks from the first whose chained hashes are cached."""
        if not self.prefix_caching:
            return []
        ids, salt, bs = token_array(token_ids), salt_bytes(salt), self.block_size

        def hashes():
            parent = ROOT
            for i in range(len(ids) // bs):
                parent = block_hash(parent, ids[i * bs:(i + 1) * bs], salt)
                yield parent
        return self.cache.match(hashes())

    def tables(self, rows, width: int | None = None) -> BlockTables:
        """The tables of ``rows``, W = ``width`` blocks each (default: the longest's)."""
        held = [self._rows[r] for r in rows]
        longest = max((len(r.blocks) for r in held), default=0)
        width = max(longest, 1) if width is None else width
        if width < longest:
            raise ValueError(f"tables of {width} blocks for a row of {longest}")
        out = np.full((len(held), width), NO_BLOCK, dtype=np.int32)
        for i, r in enumerate(held):
            out[i, :len(r.blocks)] = r.blocks
        frozen = np.array([r.frozen * self.block_size for r in held], dtype=np.int64)
        return BlockTables(out, frozen, self.block_size)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, len(self._free), self._in_use, len(self.cache),
                         len(self.cache.idle), self._peak, self._prompt, self._hits,
                         self._evictions)

    # ---- rows ------------------------------------------------------------------------------

    def admit(self, row, token_ids, salt=b"", reserve: int = 0) -> int:
        """Give new row ``row`` the blocks of prompt ``token_ids`` and ``reserve`` positions
        more: the cached blocks of its prefix (shared, never written), fresh ones for the
        rest, all or none (``OutOfBlocks``). Returns the prompt tokens served from the cache,
        a multiple of the block size below the prompt's length: the row computes (writes)
        positions from there on."""
        if row in self._rows:
            raise ValueError(f"row {row!r} holds blocks already: free it first")
        ids = token_array(token_ids)
        if len(ids) == 0:
            raise ValueError("a prompt of no tokens")
        bs = self.block_size
        shared = self.match_prefix(ids[:(len(ids) - 1) // bs * bs], salt)
        fresh = blocks_for(len(ids) + reserve, bs) - len(shared)
        idle_shared = sum(1 for b in shared if b in self.cache.idle)
        self._check_available(fresh, idle_shared)
        for b in shared:
            self._hold(b)
        self._rows[row] = _Row(shared + self._take(fresh), salt_bytes(salt),
                               [self.cache.hash_of[b] for b in shared], len(shared))
        self._prompt += len(ids)
        self._hits += len(shared) * bs
        return len(shared) * bs

    def ensure(self, row, length: int) -> None:
        """Row ``row``'s blocks hold ``length`` positions, taking the blocks it lacks, all or
        none (``OutOfBlocks``)."""
        r = self._rows[row]
        more = blocks_for(length, self.block_size) - len(r.blocks)
        if more > 0:
            self._check_available(more)
            r.blocks.extend(self._take(more))

    def seal(self, row, token_ids) -> int:
        """Row ``row``'s keys of ``token_ids`` (its tokens from position 0, prompt and
        generated) are written: its full blocks among them are registered under their
        hashes, to be shared, and frozen. Call it after the step that wrote them. Returns the
        blocks newly registered."""
        r, bs = self._rows[row], self.block_size
        ids = token_array(token_ids)
        full = min(len(ids) // bs, len(r.blocks))
        registered = 0
        for i in range(len(r.hashes), full):
            parent = r.hashes[-1] if r.hashes else ROOT
            r.hashes.append(block_hash(parent, ids[i * bs:(i + 1) * bs], r.salt))
            if self.prefix_caching:
                registered += self.cache.register(r.blocks[i], r.hashes[-1])
        r.frozen = max(r.frozen, full)
        return registered

    def fork(self, parent, child, length: int, reserve: int = 0) -> list[tuple[int, int]]:
        """New row ``child`` starts as a copy of the first ``length`` positions of row
        ``parent`` (a prompt's other samples): it shares the parent's full blocks (frozen in
        both now) and takes a fresh block for a partial last one, whose keys the caller
        copies (the (source, target) pairs returned: ``PagedKVCache.copy_blocks``), and
        fresh blocks for ``reserve`` positions more; all or none (``OutOfBlocks``)."""
        if child in self._rows:
            raise ValueError(f"row {child!r} holds blocks already: free it first")
        p, bs = self._rows[parent], self.block_size
        full, total = length // bs, blocks_for(length + reserve, bs)
        if blocks_for(length, bs) > len(p.blocks):
            raise ValueError(f"row {parent!r} holds {len(p.blocks) * bs} positions, not "
                             f"{length}")
        self._check_available(total - full)
        for b in p.blocks[:full]:
            self._hold(b)
        fresh = self._take(total - full)
        p.frozen = max(p.frozen, full)
        self._rows[child] = _Row(p.blocks[:full] + fresh, p.salt, p.hashes[:full], full)
        return [(p.blocks[full], fresh[0])] if length % bs else []

    def free(self, row) -> None:
        """Row ``row`` gives its blocks back (finished, or preempted), last to first: one
        that no row holds now is free, or idle cached if registered."""
        for b in reversed(self._rows.pop(row).blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._in_use -= 1
                if b in self.cache.hash_of:
                    self.cache.release(b)
                else:
                    self._free.append(b)

    # ---- blocks ----------------------------------------------------------------------------

    def _check_available(self, needed: int, idle_taken: int = 0) -> None:
        """Raise ``OutOfBlocks`` unless ``needed`` blocks can be taken beside
        ``idle_taken`` idle ones a request shares (those cannot be evicted for it)."""
        available = self.available() - idle_taken
        if needed > available:
            raise OutOfBlocks(needed, available)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self.cache.hold(block)
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
        self._refs[block] += 1

    def _take(self, n: int) -> list[int]:
        """``n`` fresh blocks (``_check_available`` said there are): free ones first, then
        the least recently idle cached ones."""
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block = self.cache.evict()
                self._evictions += 1
            out.append(block)
            self._hold(block)
        return out
