"""Y = X W^T as one GEMM over the flattened rows.

Weights are held transposed, W^T of shape [in, out] (contiguous for inference: on the CPU a
transposed operand costs ~20% at decode sizes; a training parameter's ``data.T`` view works
too). The backward halves: dX = dY W (``linear_input_grad``) and dW = dY^T X (the training
``GradSink.outer``, which may defer it to a zero-bubble W pass). A GEMM runs at the
hardware's peak through cuBLAS already (CuPy's 2-D ``@``: 803 TFLOP/s bf16 on an H100), so
there is no device override.
"""

from __future__ import annotations

import numpy as np


def linear(x, weight_t):
    """x (..., in) @ weight_t (in, out) -> (..., out), as a single 2-D GEMM."""
    lead = x.shape[:-1]
    return _gemm(x.reshape(-1, x.shape[-1]), weight_t).reshape(lead + (weight_t.shape[1],))


def linear_input_grad(dy, weight_t):
    """dX = dY W for Y = X W^T: dy (..., out) -> (..., in)."""
    lead = dy.shape[:-1]
    return (dy.reshape(-1, dy.shape[-1]) @ weight_t.T).reshape(lead + (weight_t.shape[0],))


def _gemm(a, b):
    """a @ b in the operands' dtype, as cuBLAS gives it: NumPy multiplies bfloat16
    (ml_dtypes') in float32 and returns that, and the cast the caller then makes would be a
    second output in the device budget (``layers.product`` casts to the weight's dtype: the
    same values)."""
    return (a @ b).astype(np.result_type(a.dtype, b.dtype), copy=False)


class Linear:
    """The op form of ``linear``, so that a device can plan its GEMMs (``ops/cuda/linear``:
    planned cuBLASLt matmuls, which a CUDA graph can capture; CuPy's cuBLAS calls cannot)."""

    def __init__(self, xp):
        self.xp = xp

    def forward(self, x, weight_t):
        return linear(x, weight_t)

    def input_grad(self, dy, weight_t):
        return linear_input_grad(dy, weight_t)
