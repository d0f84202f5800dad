"""Context parallelism: every sequence split over the ranks of a cp group, attention as ring
attention (``ring_attention``: the balanced split, the ring's forward and backward, and the
KV cache of a split sequence). The per-device attention the ring runs in tiles, and the rows
it takes, are named here too (their home is ``ops``)."""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".ring_attention": ("ContextShard", "RingAttention", "SplitKV", "split_batch"),
    "..ops.tiled_attention": ("TiledAttention",),
    "..ops.attention": ("AttentionRows", "Documents"),
})
