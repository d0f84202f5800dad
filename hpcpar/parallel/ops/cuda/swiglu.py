"""silu(gate) * up and its backward, each one elementwise pass in float32 (the reference
takes four and seven passes, rounding between them)."""

from __future__ import annotations

import cupy

from ..swiglu import SwiGLU

_forward = cupy.ElementwiseKernel(
    "T gate, T up", "T a",
    """
    const float z = static_cast<float>(gate);
    a = static_cast<T>(z / (1.0f + expf(-z)) * static_cast<float>(up));
    """, "hpcpar_swiglu")

_backward = cupy.ElementwiseKernel(
    "T da, T gate, T up", "T dgate, T dup",
    """
    const float z = static_cast<float>(gate), d = static_cast<float>(da);
    const float s = 1.0f / (1.0f + expf(-z));
    dgate = static_cast<T>(d * static_cast<float>(up) * s * (1.0f + z * (1.0f - s)));
    dup = static_cast<T>(d * z * s);
    """, "hpcpar_swiglu_backward")


class SwiGLUCuda(SwiGLU):
    def forward(self, gate, up):
        return _forward(gate, up)

    def backward(self, da, gate, up):
        return _backward(da, gate, up)
