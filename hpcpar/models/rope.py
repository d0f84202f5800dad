"""Rotary position embeddings in Hugging Face's rotate-half layout.

    inv_freq_j = theta^(-2j/d)            j = 0 .. d/2-1, then rescaled by rope_scaling
    angle(p)   = p * [inv_freq, inv_freq]  (the two halves repeat, as in transformers)
    rope(x, p) = x * cos(angle(p)) + rotate_half(x) * sin(angle(p)),
    rotate_half([x1, x2]) = [-x2, x1]

Angles are computed in float64 and rounded once to the compute dtype, so long positions lose
no precision. Positions are per row, so rows of one batch may sit at different positions.
Applying the rotation to q and k is the ``rotary`` op (``hpcpar.parallel.ops.rotary``).
"""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The d/2 rotary frequencies of ``cfg`` after its ``rope_scaling`` (float64)."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = cfg.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s.factor, s.low_freq_factor, s.high_freq_factor,
                       s.original_max_position_embeddings)
    return inv_freq


def _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, old_context):
    """Llama 3.1's rule: long wavelengths are divided by ``factor``, short ones kept, and the
    band between them interpolated smoothly."""
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos / sin tables for given positions."""

    def __init__(self, cfg: ModelConfig, xp, dtype):
        self.xp = xp
        self.dtype = dtype
        self.inv_freq = xp.asarray(inverse_frequencies(cfg))        # (d/2,) float64

    def tables(self, positions):
        """cos, sin of shape (B, T, 1, d) for int positions (B, T); the 1 broadcasts over the
        heads of q and k stored (B, T, heads, d)."""
        xp = self.xp
        angles = positions.astype(xp.float64)[:, :, None] * self.inv_freq   # (B, T, d/2)
        angles = xp.concatenate([angles, angles], axis=-1)[:, :, None]       # (B, T, 1, d)
        return xp.cos(angles).astype(self.dtype), xp.sin(angles).astype(self.dtype)
