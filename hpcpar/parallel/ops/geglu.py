"""The GeGLU activation of Gemma's MLP, with the tanh GELU (``gelu_pytorch_tanh``):

    a = gelu(gate) * up,     gelu(z) = z (1 + t) / 2,  t = tanh(c (z + 0.044715 z^3)),
                             c = sqrt(2 / pi)
    d gate = da * up * ((1 + t) / 2 + z (1 - t^2) c (1 + 3 * 0.044715 z^2) / 2),
    d up = da * gelu(gate)

The same interface as ``SwiGLU``: the MLP picks one by the config's ``activation``.
"""

from __future__ import annotations

import math

C = math.sqrt(2.0 / math.pi)
A = 0.044715


class GeGLU:
    def __init__(self, xp):
        self.xp = xp

    def _tanh(self, gate):
        return self.xp.tanh(C * (gate + A * gate * gate * gate))

    def forward(self, gate, up):
        return 0.5 * gate * (1.0 + self._tanh(gate)) * up

    def backward(self, da, gate, up):
        """(d gate, d up)."""
        t = self._tanh(gate)
        gelu = 0.5 * gate * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * C * (1.0 + 3.0 * A * gate * gate)
        return da * up * slope, da * gelu
