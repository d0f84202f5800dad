"""The SwiGLU activation of Llama's MLP:

    a = silu(gate) * up,     silu(z) = z s,  s = sigmoid(z) = 1 / (1 + exp(-z))
    d gate = da * up * s (1 + z (1 - s)),    d up = da * silu(gate)

gate and up may be views of the merged gate/up GEMM's output.
"""

from __future__ import annotations

CACHE_ELEMENTS = 1 << 16       # a block's temporaries fit a core's L2 with room to spare


class SwiGLU:
    def __init__(self, xp):
        self.xp = xp

    def forward(self, gate, up):
        """A new array: silu(gate) * up as gate / (1 + exp(-gate)) * up, in place after the
        first pass, a block of rows at a time (the five passes then run in cache)."""
        xp = self.xp
        out = xp.empty(gate.shape, dtype=gate.dtype)
        width = gate.shape[-1]
        gate, up, flat = (a.reshape(-1, width) for a in (gate, up, out))
        step = max(1, CACHE_ELEMENTS // width)
        for r0 in range(0, flat.shape[0], step):
            g, a = gate[r0:r0 + step], flat[r0:r0 + step]
            xp.negative(g, out=a)
            xp.exp(a, out=a)
            a += 1.0
            xp.divide(g, a, out=a)
            a *= up[r0:r0 + step]
        return out

    def backward(self, da, gate, up):
        """(d gate, d up)."""
        s = 1.0 / (1.0 + self.xp.exp(-gate))
        return da * up * s * (1.0 + gate * (1.0 - s)), da * gate * s
