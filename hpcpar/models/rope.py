"""Rotary position embeddings in Hugging Face's rotate-half layout.

    inv_freq_j = theta^(-2j/d)            j = 0 .. d/2-1, then rescaled by rope_scaling
    angle(p)   = p * [inv_freq, inv_freq]  (the two halves repeat, as in transformers)
    rope(x, p) = x * cos(angle(p)) + rotate_half(x) * sin(angle(p)),
    rotate_half([x1, x2]) = [-x2, x1]

d is the head's dimension, or with ``partial_rotary_factor`` the first part of it that turns
(the rest passes unturned); yarn and longrope also multiply cos and sin by an attention
factor (``attention_factor``).

Angles are computed in float64 and rounded once to the compute dtype, so long positions lose
no precision. Positions are per row, so rows of one batch may sit at different positions.
Applying the rotation to q and k is the ``rotary`` op (``hpcpar.parallel.ops.rotary``).
"""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig
from .yarn import yarn_mscale


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The d/2 rotary frequencies of ``cfg`` after its ``rope_scaling`` (float64), d the
    dimensions rotary turns (``cfg.rotary_dim``: the whole head, or its first part)."""
    d = cfg.rotary_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = cfg.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s.factor, s.low_freq_factor, s.high_freq_factor,
                       s.original_max_position_embeddings)
    if s.rope_type == "yarn":
        return _yarn(inv_freq, cfg.rope_theta, d, s)
    if s.rope_type == "longrope":            # rows within original_max: the short factors
        return inv_freq / np.asarray(s.short_factor, dtype=np.float64)
    return inv_freq


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (so each score by its square): the config's
    ``attention_factor``, else YaRN's 0.1 ln(factor) + 1 (DeepSeek's ratio of two such with
    ``mscale`` and ``mscale_all_dim``) or LongRoPE's sqrt(1 + ln(factor) / ln(original)),
    as transformers computes them; 1 for the other types."""
    s = cfg.rope_scaling
    if s.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.rope_type == "longrope":
        old = s.original_max_position_embeddings
        return 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(old))

    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def _yarn(inv_freq, theta: float, d: int, s) -> np.ndarray:
    """YaRN: the frequencies that turn fewer than ``beta_slow`` times over the original
    context divided by ``factor`` (interpolated), those that turn more than ``beta_fast``
    times kept (extrapolated), a linear ramp over the dimensions between."""
    def dimension(rotations: float) -> float:     # where a frequency turns that many times
        return (d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001                             # (transformers': no division by zero)
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp                               # the share of each frequency extrapolated
    return inv_freq / s.factor * (1 - kept) + inv_freq * kept


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
        self.scale = attention_factor(cfg)

    def tables(self, positions):
        """cos, sin of shape (B, T, 1, d) for int positions (B, T); the 1 broadcasts over the
        heads of q and k stored (B, T, heads, d)."""
        xp = self.xp
        angles = positions.astype(xp.float64)[:, :, None] * self.inv_freq   # (B, T, d/2)
        angles = xp.concatenate([angles, angles], axis=-1)[:, :, None]       # (B, T, 1, d)
        cos, sin = xp.cos(angles), xp.sin(angles)
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.astype(self.dtype), sin.astype(self.dtype)
