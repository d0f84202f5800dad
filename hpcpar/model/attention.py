"""Grouped-query self-attention over a tensor-parallel group, with a KV cache.

Each tp rank holds nh/p query heads and their KV heads (kv/p of them, or one KV head shared
by p/kv ranks when kv < p), so attention itself needs no communication; only the output
projection's AllReduce does (see ``RowParallelLinear``).
"""

from __future__ import annotations

import math

from .kv_cache import KVCache
from .parallel_layers import ColumnParallelLinear, RowParallelLinear
from .rope import RotaryEmbedding


def attention_mask(xp, pad, slot: int, length: int):
    """Which keys each query may see, (B, 1, 1, T, slot + T) boolean.

    Query t of row b sits in slot ``slot + t`` and sees keys at slots [pad_b, slot + t]: the
    causal mask and the padding mask together. A padding query (slot < pad_b) sees only
    itself, so its softmax stays finite; its output is never used.
    """
    q_slot = slot + xp.arange(length)[:, None]                   # (T, 1)
    k_slot = xp.arange(slot + length)[None, :]                   # (1, S)
    allowed = (k_slot <= q_slot) & (k_slot >= pad[:, None, None])  # (B, T, S)
    allowed |= k_slot == q_slot
    return allowed[:, None, None]                                # (B, 1, 1, T, S)


class Attention:
    """softmax(Q K^T / sqrt(d) + mask) V over this rank's heads, then the row-parallel o_proj.

    Communication: forward, one AllReduce of (B, T, hidden) inside o_proj; backward, one
    AllReduce of dX after the column-parallel q/k/v.
    """

    def __init__(self, xp, heads: int, kv_heads: int, head_dim: int,
                 qkv: ColumnParallelLinear, o: RowParallelLinear):
        self.xp = xp
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim  # per partition
        self.qkv, self.o = qkv, o
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(self, x, cos, sin, mask, cache: KVCache, layer: int, slot: int):
        xp = self.xp
        B, T, _ = x.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x)
        q = q.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)        # (B, nh, T, hd)
        k = k.reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)       # (B, nkv, T, hd)
        v = v.reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)       # (B, nkv, T, hd)
        q = RotaryEmbedding.apply(q, cos, sin, xp)
        k = RotaryEmbedding.apply(k, cos, sin, xp)
        keys, values = cache.append(layer, k, v, slot)           # (B, nkv, S, hd)

        # The g query heads that share a KV head are stacked as rows of one product, so
        # each (row, KV head) is a single GEMM against its keys, with no broadcast copies.
        group = nh // nkv
        q = (q * self.scale).reshape(B, nkv, group * T, hd)      # (B, nkv, g*T, hd)
        scores = q @ keys.transpose(0, 1, 3, 2)                  # (B, nkv, g*T, S)
        scores = scores.astype(xp.float32, copy=False).reshape(B, nkv, group, T, -1)
        scores = xp.where(mask, scores, -xp.inf)                 # (B, nkv, g, T, S)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        probs = probs.astype(x.dtype, copy=False).reshape(B, nkv, group * T, -1)
        out = (probs @ values).reshape(B, nkv, group, T, hd)     # (B, nkv, g, T, hd)
        out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, nh * hd)  # (B, T, nh*hd)
        return self.o(out)
