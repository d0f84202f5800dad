"""Rotary position embedding in Hugging Face's rotate-half layout, on q and k together:

    rope(x, p) = x cos(p) + R(x) sin(p),    R([x1, x2]) = [-x2, x1]

q (B, T, heads, d) and k (B, T, kv_heads, d) as the qkv GEMM leaves them (views are fine);
cos and sin (B, T, 1, r) broadcast over the heads (``models.rope.RotaryEmbedding.tables``):
r = d, or with partial rotary r < d, the first r dimensions turned and the rest passed.
R is orthogonal with R^T = -R, so the backward is dx = dy cos - R(dy sin).
"""

from __future__ import annotations


def _halves(x):
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


class Rotary:
    def __init__(self, xp):
        self.xp = xp

    def apply(self, x, cos, sin):
        """rope(x) for one tensor (new array); tables narrower than x turn its first
        dimensions only (partial rotary), the rest copied."""
        return self._partial(self._turn, x, cos, sin)

    def backward_one(self, dy, cos, sin):
        """dy cos - R(dy sin) (the turned dimensions; the rest pass as they are)."""
        return self._partial(self._turn_back, dy, cos, sin)

    def _partial(self, turn, x, cos, sin):
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return turn(x, cos, sin)
        out = x.copy()
        out[..., :rot] = turn(x[..., :rot], cos, sin)
        return out

    def _turn(self, x, cos, sin):
        """x cos, then R(x) sin added half by half, with no rotated copy of x (x1 c - x2 s
        equals x1 c + (-x2) s bit for bit)."""
        out = x * cos
        (x1, x2), (s1, s2), (o1, o2) = _halves(x), _halves(sin), _halves(out)
        o1 -= x2 * s1
        o2 += x1 * s2
        return out

    def forward(self, q, k, cos, sin):
        """(rope(q), rope(k)), new contiguous arrays."""
        return self.apply(q, cos, sin), self.apply(k, cos, sin)

    def _turn_back(self, dy, cos, sin):
        """dy cos - R(dy sin), half by half."""
        dx = dy * cos
        (d1, d2), (s1, s2), (o1, o2) = _halves(dy), _halves(sin), _halves(dx)
        o1 += d2 * s2
        o2 -= d1 * s1
        return dx

    def backward(self, dq, dk, cos, sin):
        """(dq, dk) before the rotation."""
        return self.backward_one(dq, cos, sin), self.backward_one(dk, cos, sin)
