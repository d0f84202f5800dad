"""Rotary position embedding in Hugging Face's rotate-half layout, on q and k together:

    rope(x, p) = x cos(p) + R(x) sin(p),    R([x1, x2]) = [-x2, x1]

q (B, T, heads, d) and k (B, T, kv_heads, d) as the qkv GEMM leaves them (views are fine);
cos and sin (B, T, 1, d) broadcast over the heads (``model.rope.RotaryEmbedding.tables``).
R is orthogonal with R^T = -R, so the backward is dx = dy cos - R(dy sin).
"""

from __future__ import annotations


def _rotate_half(xp, x):
    half = x.shape[-1] // 2
    return xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Rotary:
    def __init__(self, xp):
        self.xp = xp

    def apply(self, x, cos, sin):
        """rope(x) for one tensor (new array)."""
        return x * cos + _rotate_half(self.xp, x) * sin

    def forward(self, q, k, cos, sin):
        """(rope(q), rope(k)), new contiguous arrays."""
        return self.apply(q, cos, sin), self.apply(k, cos, sin)

    def backward_one(self, dy, cos, sin):
        ds = dy * sin
        half = dy.shape[-1] // 2
        return dy * cos - self.xp.concatenate([-ds[..., half:], ds[..., :half]], axis=-1)

    def backward(self, dq, dk, cos, sin):
        """(dq, dk) before the rotation."""
        return self.backward_one(dq, cos, sin), self.backward_one(dk, cos, sin)
