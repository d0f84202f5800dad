"""The key/value cache of one pipeline stage for one micro-batch, allocated once.

Each row's tokens come first: a prompt of length L fills slots [0, L) and decode step t writes
slot L + t - 1 of its own row, so rows of one batch may hold different numbers of tokens (the
per-row lengths travel in ``AttentionRows``). Slots past a row's length are never read as
keys; they hold zeros or finished values (never NaN: a fused kernel still multiplies them by a
zero probability).
"""

from __future__ import annotations


class KVCache:
    """k and v of shape (layers, batch, kv_heads_per_partition, capacity, head_dim)."""

    def __init__(self, xp, num_layers: int, batch: int, kv_heads: int, capacity: int,
                 head_dim: int, dtype):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)
        self.v = xp.zeros(shape, dtype=dtype)
        self.capacity = capacity
        self.xp = xp

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, k, v, starts, from_start: bool, max_kv: int):
        """Store k, v (B, T, kv, hd) at slots [starts[b], starts[b] + T) of each row b and
        return the first ``max_kv`` slots of the layer's keys and values, views of shape
        (B, kv, max_kv, hd)."""
        if max_kv > self.capacity:
            raise IndexError(f"KV cache holds {self.capacity} slots, step needs {max_kv}")
        B, T = k.shape[:2]
        if from_start:                     # prefill: one slice for every row
            self.k[layer, :, :, :T] = k.transpose(0, 2, 1, 3)
            self.v[layer, :, :, :T] = v.transpose(0, 2, 1, 3)
        else:                              # each row at its own slots
            xp = self.xp
            rows = xp.arange(B)[:, None]                              # (B, 1)
            slots = starts[:, None] + xp.arange(T)[None, :]           # (B, T)
            self.k[layer][rows, :, slots] = k                          # (B, T, kv, hd)
            self.v[layer][rows, :, slots] = v
        return self.k[layer, :, :, :max_kv], self.v[layer, :, :, :max_kv]


def kv_cache_bytes(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                   itemsize: int) -> int:
    """What ``KVCache`` allocates, for planning without allocating."""
    return 2 * num_layers * batch * kv_heads * capacity * head_dim * itemsize
