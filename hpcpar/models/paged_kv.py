"""A KV cache in blocks (vLLM's paged attention): a stage's keys and values in ``num_blocks``
blocks of ``block_size`` positions, allocated once, read and written through the block tables
``kv_blocks.BlockPool`` keeps.

``PagedKVCache.write`` has ``KVCache.write``'s interface, so the attention layer and op run
unchanged: it scatters the step's keys to their blocks and returns each row's blocks
gathered, (B, kv_heads, W block_size, head_dim) for tables of W blocks. A row's shared and
sealed blocks (its frozen prefix) are never written: ``bind`` refuses a step that starts in
them where the host knows the starts, and on the device any write there, and padding past a
row's blocks, goes to a block of its own (the null block, which no row reads as a key). The
gather is the reference; a kernel reading the blocks through the tables (cuDNN's and vLLM's
paged attention) would skip its copy.
"""

from __future__ import annotations

import copy

import numpy as np

from ..parallel.ops.cascade_attention import PrefixGroups
from .kv_blocks import NO_BLOCK, BlockTables, block_bytes, check_block_size


def paged_kv_cache_bytes(num_layers: int, num_blocks: int, kv_heads: int, block_size: int,
                         head_dim: int, itemsize: int, v_dim: int | None = None) -> int:
    """What ``PagedKVCache`` allocates (its null block too), for planning without
    allocating."""
    return (num_blocks + 1) * block_bytes(num_layers, kv_heads, block_size, head_dim, itemsize,
                                          v_dim)


class PagedKVCache:
    """k and v of shape (layers, num_blocks + 1, kv_heads_per_partition, block_size,
    head_dim), the last block the null block (v's last dimension ``v_dim`` where given: 0
    for latent attention); a step's rows read and write through the block tables it is
    bound to (``bind``)."""

    def __init__(self, ops, num_layers: int, num_blocks: int, kv_heads: int, block_size: int,
                 head_dim: int, dtype, v_dim: int | None = None):
        self.block_size = check_block_size(block_size)
        shape = (num_layers, num_blocks + 1, kv_heads, block_size, head_dim)
        self.xp = ops.xp
        self.v_dim = head_dim if v_dim is None else v_dim
        self.k = self.xp.zeros(shape, dtype=dtype)
        self.v = self.xp.zeros(shape[:-1] + (self.v_dim,), dtype=dtype)
        self.num_blocks, self.kv_heads, self.head_dim = num_blocks, kv_heads, head_dim
        self.null_block = num_blocks
        self.tables: BlockTables | None = None
        self._blocks = self._frozen = None            # the bound tables on the device
        self.rows_k = self.rows_v = None              # ``contiguous``: the bound rows' keys
        self.prefix_groups: PrefixGroups | None = None   # ``contiguous``: rows that share keys

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def rows_nbytes(self) -> int:
        """The bytes of a ``contiguous`` view's copy of its rows' keys and values."""
        return 0 if self.rows_k is None else self.rows_k.nbytes + self.rows_v.nbytes

    def contiguous(self) -> "PagedKVCache":
        """This view also keeps its rows' keys and values in position order, (layers, B,
        kv, W block_size, hd), so that a step reads them without gathering its blocks (a
        decode step's attention reads every row's keys, the gather would copy them all each
        step): ``write`` stores a step's keys in both, and ``bind`` copies in the rows whose
        blocks changed, or ``refresh`` names (written through another view), and finds the
        rows whose tables begin alike (``prefix_groups``: a decode step's attention reads
        their shared keys once, ``ops.cascade_attention``)."""
        B, W = self._blocks.shape
        # one position more, where the writes the pool sends to its null block go
        shape = (self.k.shape[0], B, self.kv_heads, W * self.block_size + 1, self.head_dim)
        self.rows_k = self.xp.zeros(shape, dtype=self.k.dtype)
        self.rows_v = self.xp.zeros(shape[:-1] + (self.v_dim,), dtype=self.v.dtype)
        self._gather_rows(np.arange(B))
        return self

    @property
    def capacity(self) -> int:
        """The positions the bound tables hold per row (W block_size): the keys ``write``
        returns."""
        return 0 if self.tables is None else self.tables.blocks.shape[1] * self.block_size

    def bind(self, tables: BlockTables, starts=None, lengths=None,
             refresh=()) -> "PagedKVCache":
        """The next steps' rows are those of ``tables`` (``BlockPool.tables``), checked
        against the step's first written positions ``starts`` and lengths ``lengths``
        where given (host integers (B,): ``BlockTables.check``). Tables of the shape bound
        before go to the same device arrays (fixed addresses: a CUDA graph replays). A
        ``contiguous`` view copies in the rows whose blocks changed and those of
        ``refresh``."""
        blocks = np.asarray(tables.blocks)
        if (blocks.ndim != 2 or tables.block_size != self.block_size
                or (blocks.size and (blocks.min() < NO_BLOCK
                                     or blocks.max() >= self.num_blocks))):
            raise ValueError(f"block tables of shape {blocks.shape}, block size "
                             f"{tables.block_size}, for {self.num_blocks} blocks of "
                             f"{self.block_size}")
        tables.check(starts, lengths)
        xp = self.xp
        device = xp.asarray(np.where(blocks < 0, self.null_block, blocks).astype(np.int32))
        frozen = xp.asarray(np.asarray(tables.frozen).astype(np.int32))
        before = None if self.tables is None else np.asarray(self.tables.blocks)
        if self.rows_k is not None and before.shape != blocks.shape:
            raise ValueError(f"a contiguous view keeps its tables' shape {before.shape}, "
                             f"not {blocks.shape}")
        if self._blocks is not None and self._blocks.shape == device.shape:
            self._blocks[...], self._frozen[...] = device, frozen
        else:
            self._blocks, self._frozen = device, frozen
        self.tables = tables
        if self.rows_k is not None:
            # a row's blocks that were its before hold its keys already; blocks it took
            # since hold nothing yet (its writes go to both)
            changed = ((before != blocks) & (before >= 0)).any(axis=1)
            changed[np.asarray(refresh, dtype=np.int64)] = True
            self._gather_rows(np.flatnonzero(changed))
            self.prefix_groups = PrefixGroups.of_tables(blocks, self.block_size)
        return self

    def _gather_rows(self, rows: np.ndarray) -> None:
        """A ``contiguous`` view's ``rows`` copied in from their blocks, a layer at a time
        (its temporaries stay small), straight into the copy's positions seen as blocks."""
        if len(rows):
            xp, W, bs = self.xp, self._blocks.shape[1], self.block_size
            index = xp.asarray(rows)
            blocks = self._blocks[index]                               # (n, W)
            for store, rows_store in ((self.k, self.rows_k), (self.v, self.rows_v)):
                # (layers, B, kv, W, bs, hd): a view of all positions but the last
                as_blocks = rows_store[:, :, :, :W * bs].reshape(
                    rows_store.shape[:3] + (W, bs, rows_store.shape[-1]))
                for layer in range(store.shape[0]):
                    as_blocks[layer, index] = store[layer][blocks].transpose(0, 2, 1, 3, 4)

    def rows(self, tables: BlockTables, starts=None, lengths=None) -> "PagedKVCache":
        """This cache (the same arrays) bound to other rows' tables, this one's binding kept:
        a step of some rows alone (a prefill of new prompts while others decode), as
        ``CacheRows`` is of a ``KVCache``."""
        view = copy.copy(self)
        view.tables = view._blocks = view._frozen = view.rows_k = view.rows_v = None
        view.prefix_groups = None
        return view.bind(tables, starts, lengths)

    def slots(self, starts, T: int):
        """(block, offset), each (B, T): where positions [starts[b], starts[b] + T) of each
        row go. A position of the row's frozen prefix, or past its blocks, goes to the null
        block."""
        xp, bs = self.xp, self.block_size
        B, W = self._blocks.shape
        position = starts.astype(xp.int64)[:, None] + xp.arange(T)[None, :]
        column = position // bs
        block = self._blocks[xp.arange(B)[:, None], xp.minimum(column, W - 1)]
        keep = (column < W) & (position >= self._frozen[:, None])
        return xp.where(keep, block, self.null_block), position % bs

    def write(self, layer: int, k, v, starts, from_start: bool, max_kv: int):
        """``KVCache.write``: store k, v (B, T, kv, hd) at positions [starts[b], starts[b] +
        T) of each row b and return the layer's keys and values of the bound rows, (B, kv,
        W block_size, hd) gathered from their blocks; for a prefill from position 0 the
        step's own (B, kv, T, hd), as ``CacheRows`` returns."""
        B, T = k.shape[:2]
        if self.tables is None or self._blocks.shape[0] != B:
            raise ValueError(f"a step of {B} rows, and the cache is bound to "
                             f"{0 if self.tables is None else self._blocks.shape[0]}: "
                             f"bind the step's block tables first")
        if max_kv > self.capacity:
            raise IndexError(f"block tables hold {self.capacity} positions, step needs "
                             f"{max_kv}")
        if isinstance(starts, np.ndarray):           # on the host the check costs nothing
            self.tables.check(starts)
        block, offset = self.slots(starts, T)
        self.k[layer][block, :, offset] = k                  # (B, T, kv, hd)
        self.v[layer][block, :, offset] = v
        if self.rows_k is not None:
            return self._write_rows(layer, k, v, starts, block)
        if from_start:
            return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return self.gather(layer)

    def _write_rows(self, layer: int, k, v, starts, block):
        """A ``contiguous`` view's step: its keys at their positions of the rows' copy too
        (those ``slots`` sent to the null block, none), and the copy's layer returned."""
        xp = self.xp
        B, T = k.shape[:2]
        held = self.rows_k.shape[3] - 1
        position = starts.astype(xp.int64)[:, None] + xp.arange(T)[None, :]      # (B, T)
        position = xp.where(block == self.null_block, held, position)
        keys, values = self.rows_k[layer], self.rows_v[layer]
        rows = xp.arange(B)[:, None]
        keys[rows, :, position] = k                                      # (B, T, kv, hd)
        values[rows, :, position] = v
        return keys[:, :, :held], values[:, :, :held]

    def gather(self, layer: int):
        """The layer's keys and values of the bound rows, (B, kv, W block_size, hd): a copy
        of their blocks in position order."""
        B, W = self._blocks.shape
        heads = self.xp.arange(self.kv_heads)[None, :, None]
        shape = (B, self.kv_heads, W * self.block_size)
        index = (self._blocks[:, None, :], heads)                # -> (B, kv, W, bs, hd)
        return (self.k[layer][index].reshape(shape + (self.head_dim,)),
                self.v[layer][index].reshape(shape + (self.v_dim,)))

    def copy_blocks(self, pairs) -> None:
        """Block target becomes a copy of block source in every layer, for each (source,
        target) of ``pairs`` (``BlockPool.fork``: a partial block a new row goes on
        writing)."""
        if len(pairs):
            xp = self.xp
            source, target = (xp.asarray(np.asarray(p, dtype=np.int64)) for p in zip(*pairs))
            self.k[:, target] = self.k[:, source]
            self.v[:, target] = self.v[:, source]
