"""Rotary embedding as one elementwise pass per tensor over the two halves of the head
dimension (the reference concatenates a rotated copy first: four passes), math in float32.
cos and sin broadcast over the heads; q and k may be strided views of the qkv GEMM output."""

from __future__ import annotations

import cupy

from ..rotary import Rotary

# o = rope(x) with sign = 1:  o1 = x1 c - x2 s,  o2 = x2 c + x1 s
# dx = rope^T(dy), sign = -1: dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s
_rope = cupy.ElementwiseKernel(
    "T x1, T x2, T c, T s, float32 sign", "T o1, T o2",
    """
    const float a = static_cast<float>(x1), b = static_cast<float>(x2);
    const float cc = static_cast<float>(c), ss = sign * static_cast<float>(s);
    o1 = static_cast<T>(a * cc - b * ss);
    o2 = static_cast<T>(b * cc + a * ss);
    """, "hpcpar_rope")


class RotaryCuda(Rotary):
    def _run(self, x, cos, sin, sign: float):
        half = x.shape[-1] // 2
        out = cupy.empty(x.shape, dtype=x.dtype)
        # the two halves of the angle table are equal (transformers repeats them)
        _rope(x[..., :half], x[..., half:], cos[..., :half], sin[..., :half],
              cupy.float32(sign), out[..., :half], out[..., half:])
        return out

    def _turn(self, x, cos, sin):
        return self._run(x, cos, sin, 1.0)

    def _turn_back(self, dy, cos, sin):
        return self._run(dy, cos, sin, -1.0)
