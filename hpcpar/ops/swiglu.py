"""The SwiGLU activation of Llama's MLP:

    a = silu(gate) * up,     silu(z) = z s,  s = sigmoid(z) = 1 / (1 + exp(-z))
    d gate = da * up * s (1 + z (1 - s)),    d up = da * silu(gate)

gate and up may be views of the merged gate/up GEMM's output.
"""

from __future__ import annotations


class SwiGLU:
    def __init__(self, xp):
        self.xp = xp

    def forward(self, gate, up):
        """A new array: silu(gate) * up as gate / (1 + exp(-gate)) * up, in place after the
        first pass (one temporary instead of five)."""
        xp = self.xp
        a = xp.negative(gate)
        xp.exp(a, out=a)
        a += 1.0
        xp.divide(gate, a, out=a)
        a *= up
        return a

    def backward(self, da, gate, up):
        """(d gate, d up)."""
        s = 1.0 / (1.0 + self.xp.exp(-gate))
        return da * up * s * (1.0 + gate * (1.0 - s)), da * gate * s
