"""The key/value cache of one pipeline stage for one micro-batch, allocated once.

All rows of a micro-batch share one timeline of cache slots: a left-padded prompt of length
L fills slots [0, L), decode step t writes slot L + t - 1. A row's padding occupies its first
``pad`` slots, which the attention mask hides; rotary positions are per row (slot - pad).
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

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def append(self, layer: int, k, v, slot: int):
        """Store k, v (B, kv, T, hd) at slots [slot, slot + T) and return every key and value
        up to slot + T, views of shape (B, kv, slot + T, hd)."""
        end = slot + k.shape[2]
        if end > self.capacity:
            raise IndexError(f"KV cache holds {self.capacity} slots, step needs {end}")
        self.k[layer, :, :, slot:end] = k
        self.v[layer, :, :, slot:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def kv_cache_bytes(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                   itemsize: int) -> int:
    """What ``KVCache`` allocates, for planning without allocating."""
    return 2 * num_layers * batch * kv_heads * capacity * head_dim * itemsize
