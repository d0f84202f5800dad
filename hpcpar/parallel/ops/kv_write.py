"""Writing a step's keys and values into the KV cache, each row at its own slots:

    cache[b, h, starts[b] + t, :] = k[b, t, h, :]        for t < T (and the same for v)

k and v (B, T, kv_heads, d) as the qkv GEMM leaves them (views fine); the cache layer
(B, kv_heads, capacity, d). Prefill from position 0 is one slice assignment per tensor;
otherwise the reference scatters with advanced indices (five small array operations).
"""

from __future__ import annotations


class KVWrite:
    def __init__(self, xp):
        self.xp = xp

    def forward(self, cache_k, cache_v, k, v, starts, from_start: bool) -> None:
        B, T = k.shape[:2]
        if from_start:
            cache_k[:, :, :T] = k.transpose(0, 2, 1, 3)
            cache_v[:, :, :T] = v.transpose(0, 2, 1, 3)
            return
        xp = self.xp
        rows = xp.arange(B)[:, None]                              # (B, 1)
        slots = starts[:, None] + xp.arange(T)[None, :]           # (B, T)
        cache_k[rows, :, slots] = k                               # (B, T, kv, d)
        cache_v[rows, :, slots] = v
