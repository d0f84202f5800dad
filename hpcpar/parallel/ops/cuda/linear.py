"""Y = X W^T that a CUDA graph can capture.

CuPy's matmul (cuBLAS) runs every eager product: it is at the GEMM ceiling already (803
TFLOP/s bf16 on an H100) and cheap to call. But it refuses a capturing stream ("calling cuBLAS
API during stream capture is currently unsupported"), so while a graph is prepared and captured
(``capture_safe``, ``parallel.device.graphs``) the products go through nvmath-python's planned
cuBLASLt matmul, which capture records (16 GEMMs: 0.53 ms eager, 0.125 ms replayed, measured
on an H100: ../shared/notes/gpu-h100.md). One plan per shape and dtype of the operands, made
on the graph's eager warm-up step and reused by its capture with the operands reset.
"""

from __future__ import annotations

from contextlib import contextmanager

import cupy

from ...errors import HpcparError
from ..linear import Linear, linear

_planned = 0            # inside ``capture_safe``: the products take the planned matmul


@contextmanager
def capture_safe():
    """Products in the block run nvmath's planned matmul (a graph's warm-up and capture)."""
    global _planned
    _planned += 1
    try:
        yield
    finally:
        _planned -= 1


def _matmul_class():
    try:
        from nvmath.linalg.advanced import Matmul
    except ImportError as e:
        raise HpcparError(f"CUDA-graph decode needs nvmath-python's matmul ({e}): pip install "
                          "'nvmath-python[cu12]' (or [cu13]: hpcpar's gpu-cuda12 / gpu-cuda13 "
                          "extras bring it), or run without --cuda-graphs") from None
    return Matmul


class LinearCuda(Linear):
    def __init__(self, xp):
        super().__init__(xp)
        self._plans: dict = {}

    def forward(self, x, weight_t):
        if not _planned:
            return linear(x, weight_t)
        lead = x.shape[:-1]
        x2 = cupy.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        return self._planned_product(x2, weight_t).reshape(lead + (weight_t.shape[1],))

    def input_grad(self, dy, weight_t):
        if not _planned:
            return super().input_grad(dy, weight_t)
        lead = dy.shape[:-1]
        dy2 = cupy.ascontiguousarray(dy.reshape(-1, dy.shape[-1]))
        return self._planned_product(dy2, weight_t.T).reshape(lead + (weight_t.shape[0],))

    def _planned_product(self, a, b):
        """a @ b on the current stream through a plan of their shapes, dtypes and strides."""
        stream = cupy.cuda.get_current_stream()
        key = (a.shape, b.shape, a.strides, b.strides, a.dtype.str, b.dtype.str)
        mm = self._plans.get(key)
        if mm is None:
            mm = _matmul_class()(a, b, stream=stream)
            mm.plan(stream=stream)
            self._plans[key] = mm
        else:
            mm.reset_operands(a=a, b=b, stream=stream)
        return mm.execute(stream=stream)
