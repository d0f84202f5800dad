"""Floating-point formats by name: float32, float16, bfloat16 (through ml_dtypes), float64.

NumPy has no bfloat16 of its own; ``ml_dtypes`` provides one that NumPy, safetensors and our
MPI layer understand. HDF5 has none either, so checkpoints store bfloat16 as its raw 16 bits
(uint16) and mark the dataset (see ``hpcpar.checkpoint.format``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import HpcparError

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


def at_least_float32(xp, a):
    """``a`` in float32 when it is a 16-bit float (statistics, softmax, losses), else itself:
    no copy."""
    return a if a.dtype.itemsize >= 4 else a.astype(xp.float32)


def accumulator(xp, dtype):
    """Where sums and softmax statistics are kept: float32, or float64 for float64 work."""
    return xp.float64 if dtype == xp.float64 else xp.float32


# a float is NaN or inf exactly when its exponent bits are all ones
_EXPONENT_MASKS = {"float64": (np.uint64, 0x7FF0000000000000), "float32": (np.uint32, 0x7F800000),
                   "float16": (np.uint16, 0x7C00), "bfloat16": (np.uint16, 0x7F80)}


# the bytes of a tensor ``any_nonfinite`` tests at a time: its temporaries are a loading's only
# device bytes beside the weights (10 MB in float32), and 16 GB of weights take 2,000 blocks
CHECK_BLOCK_BYTES = 8 << 20


def any_nonfinite(xp, a):
    """Whether ``a`` holds a NaN or inf anywhere, as a device boolean (no host read): the
    test of ``nonfinite`` a block of at most ``CHECK_BLOCK_BYTES`` at a time, so that checking
    a large tensor (a vocabulary's embedding) needs no temporary its size
    (``check_temporary_bytes``)."""
    flat = a.reshape(-1)
    step = _check_step(a.itemsize)
    found = None
    for start in range(0, flat.size, step):
        part = nonfinite(xp, flat[start:start + step]).any()
        found = part if found is None else found | part
    return found if found is not None else xp.zeros((), dtype=bool)


def _check_step(itemsize: int) -> int:
    return max(1, CHECK_BLOCK_BYTES // max(itemsize, 1))


def check_temporary_bytes(numel: int, itemsize: int) -> int:
    """The device bytes ``any_nonfinite`` holds at once checking a tensor of ``numel``
    elements: one block's bits masked (its own width) and their comparison (a bool each)."""
    return min(numel, _check_step(itemsize)) * (itemsize + 1)


def nonfinite(xp, a):
    """Where ``a`` (a float array of NumPy or CuPy) holds NaN or inf, from its bits: the same
    integer test on every backend, bfloat16 included, and no host copy of a device array."""
    uint, mask = _EXPONENT_MASKS[dtype_name(a.dtype)]
    return (a.view(uint) & uint(mask)) == uint(mask)
