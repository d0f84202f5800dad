"""Grouped-query self-attention over a tensor-parallel group, with a KV cache.

Each tp rank holds nh/p query heads and their KV heads (kv/p of them, or one KV head shared
by p/kv ranks when kv < p), so attention itself needs no communication; only the output
projection's AllReduce does (see ``RowParallelLinear``). The math is the ops layer's:
rotary on q and k, then the ``attention`` op over the cache with per-row lengths.
"""

from __future__ import annotations

from ..ops import AttentionRows, Ops
from .kv_cache import KVCache
from .parallel_layers import ColumnParallelLinear, RowParallelLinear


class Attention:
    """o_proj(softmax(rope(Q) rope(K)^T / sqrt(d) + mask) V) over this rank's heads.

    Communication: forward, one AllReduce of (B, T, hidden) inside o_proj; backward, one
    AllReduce of dX after the column-parallel q/k/v.
    """

    def __init__(self, ops: Ops, heads: int, kv_heads: int, head_dim: int,
                 qkv: ColumnParallelLinear, o: RowParallelLinear):
        self.ops = ops
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim  # per partition
        self.qkv, self.o = qkv, o

    def __call__(self, x, cos, sin, rows: AttentionRows, cache: KVCache, layer: int):
        B, T, _ = x.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x)
        q = q.reshape(B, T, nh, hd)                                   # (B, T, nh, hd)
        k = k.reshape(B, T, nkv, hd)                                  # (B, T, nkv, hd)
        v = v.reshape(B, T, nkv, hd)
        q, k = self.ops.rotary.forward(q, k, cos, sin)
        keys, values = cache.write(layer, k, v, rows.starts(), rows.from_start, rows.max_kv)
        out = self.ops.attention.forward(q, keys, values, rows)       # (B, T, nh, hd)
        return self.o(out.reshape(B, T, nh * hd))
