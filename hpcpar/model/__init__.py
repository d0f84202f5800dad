"""The decoder every model family runs, as tensor-parallel pipeline stages (NumPy or CuPy
through ``xp``); the families themselves are in ``hpcpar.models``."""

from .kv_cache import CacheRows, KVCache, kv_cache_bytes
from .decoder import DecoderStage
from .rope import RotaryEmbedding, inverse_frequencies

__all__ = ["CacheRows", "KVCache", "DecoderStage", "RotaryEmbedding", "inverse_frequencies",
           "kv_cache_bytes"]
