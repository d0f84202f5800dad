"""The key/value cache of one pipeline stage for one micro-batch, allocated once.

Each row's tokens come first: a prompt of length L fills slots [0, L) and decode step t writes
slot L + t - 1 of its own row, so rows of one batch may hold different numbers of tokens (the
per-row lengths travel in ``AttentionRows``). Slots past a row's length are never read as
keys; they hold zeros or finished values (never NaN: a fused kernel still multiplies them by a
zero probability).
"""

from __future__ import annotations


def kv_dims(cfg) -> tuple[int, int]:
    """(key, value) dimensions of a cached head of ``cfg``: head_dim both, or latent
    attention's one head of latent and rope key, held as keys, with no values (they are
    the keys: ``models.latent_attention``)."""
    if cfg.mla:
        return cfg.kv_lora_rank + cfg.head_dim, 0
    return cfg.head_dim, cfg.head_dim


def kv_entry(cfg, tp: int) -> tuple[int, int, int]:
    """(heads, key dims, value dims) a tp rank caches per token and layer: its KV heads (a
    KV head held by several ranks counts on each), or latent attention's one latent head,
    the same on every tp rank (replicated, not split)."""
    k, v = kv_dims(cfg)
    return (1 if cfg.mla else max(cfg.num_key_value_heads // tp, 1)), k, v


class KVCache:
    """k and v of shape (layers, batch, kv_heads_per_partition, capacity, head_dim) (v's last
    dimension ``v_dim`` where given: 0 for latent attention)."""

    def __init__(self, ops, num_layers: int, batch: int, kv_heads: int, capacity: int,
                 head_dim: int, dtype, v_dim: int | None = None):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = ops.xp.zeros(shape, dtype=dtype)
        self.v = ops.xp.zeros(shape[:-1] + (head_dim if v_dim is None else v_dim,),
                              dtype=dtype)
        self.capacity = capacity
        self.kv_write = ops.kv_write

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_rows(self, source, target) -> None:
        """Rows ``target`` of every layer become copies of rows ``source`` (a prompt's
        prefilled keys and values shared by its samples)."""
        self.k[:, target] = self.k[:, source]
        self.v[:, target] = self.v[:, source]

    def write(self, layer: int, k, v, starts, from_start: bool, max_kv: int):
        """Store k, v (B, T, kv, hd) at slots [starts[b], starts[b] + T) of each row b and
        return the layer's keys and values, views of shape (B, kv, capacity, hd): the whole
        cache, so that a fused kernel sees one shape for every decode step (the lengths say
        which slots count; the reference reads only the first ``max_kv``)."""
        if max_kv > self.capacity:
            raise IndexError(f"KV cache holds {self.capacity} slots, step needs {max_kv}")
        self.kv_write.forward(self.k[layer], self.v[layer], k, v, starts, from_start)
        return self.k[layer], self.v[layer]


class CacheRows:
    """Some rows of a ``KVCache`` being filled from position 0 by a prefill of those rows
    alone (continuous batching gives a finished row's slot to the next prompt): the step's
    keys and values go to the rows ``slots``, and attention reads the step's own; a chunk of
    a long prefill (``DecoderStage``) goes to slots [max_kv - T, max_kv) of every row (its
    one start) and reads the keys before it from the cache too."""

    def __init__(self, cache: KVCache, slots):
        self.cache, self.slots = cache, slots

    def write(self, layer: int, k, v, starts, from_start: bool, max_kv: int):
        T = k.shape[1]
        if max(T, max_kv) > self.cache.capacity:
            raise IndexError(f"KV cache holds {self.cache.capacity} slots, step needs "
                             f"{max(T, max_kv)}")
        keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)   # (b, kv, T, d)
        start, stop = (0, T) if from_start else (max_kv - T, max_kv)
        self.cache.k[layer][self.slots, :, start:stop] = keys
        self.cache.v[layer][self.slots, :, start:stop] = values
        if from_start:
            return keys, values
        return (self.cache.k[layer][self.slots, :, :stop],
                self.cache.v[layer][self.slots, :, :stop])


def kv_cache_bytes(num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                   itemsize: int, v_dim: int | None = None) -> int:
    """What ``KVCache`` allocates, for planning without allocating."""
    dims = head_dim + (head_dim if v_dim is None else v_dim)
    return num_layers * batch * kv_heads * capacity * dims * itemsize
