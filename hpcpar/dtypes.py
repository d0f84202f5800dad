"""Floating-point formats by name: float32, float16, bfloat16 (through ml_dtypes), float64.

NumPy has no bfloat16 of its own; ``ml_dtypes`` provides one that NumPy, safetensors and our
MPI layer understand. HDF5 has none either, so checkpoints store bfloat16 as its raw 16 bits
(uint16) and mark the dataset (see ``hpcpar.checkpoint.format``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import HpcparError

bfloat16 = np.dtype(ml_dtypes.bfloat16)

FLOAT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": bfloat16,
    "float64": np.dtype(np.float64),
}


def float_dtype(name: str) -> np.dtype:
    try:
        return FLOAT_DTYPES[name]
    except KeyError:
        raise HpcparError(f"dtype {name!r} is not one of {', '.join(FLOAT_DTYPES)}") from None


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == bfloat16 else dtype.name
