"""What a step captured as a CUDA graph may do, checked on the CPU.

A CUDA graph records a step's kernels once and replays them: the host's part of the step does
not run again. So a captured step must not read the device back (a sync: the graph holds no
host code), must not copy host data in (the graph would replay the first step's data), must
launch only what stream capture accepts (CuPy's own matmul refuses: cuBLAS during capture), and
must be, at every step, the same computation on the same shapes (a Python value that changes
from step to step would be frozen at its first one). On the strict device backend
(``parallel.device.strict_arrays``) every array operation passes through here while a ``Capture`` is
active: the first three are refused with an ``HpcparError`` naming what to change, and each
operation is recorded, with its operands' shapes and dtypes and its host arguments, so that a
replay can be compared with the capture (``parallel.device.graphs``).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import numpy as np

from ..errors import HpcparError

_active: "Capture | None" = None

# the products CuPy runs through cuBLAS (its matmul refuses a capturing stream)
GEMMS = frozenset({"matmul", "dot", "tensordot", "einsum", "inner", "vdot"})


class CaptureError(HpcparError):
    """A step under capture did what a CUDA graph cannot hold (or a replay differed)."""


class Capture:
    """The record of one run of a step under capture (``active``)."""

    def __init__(self, what: str):
        self.what = what              # for messages: "the decode step of 4 rows"
        self.ops: list[tuple] = []
        self._kernels = 0             # inside a device kernel's reference (ops.counted)

    def record(self, name: str, args) -> None:
        if self._kernels:                 # inside a kernel: its launch is what is recorded
            return
        if name in GEMMS:
            raise CaptureError(
                f"{self.what} runs an array {name} outside the ops' capture-safe GEMM "
                "(CuPy's matmul refuses CUDA-graph capture): route the product through "
                "ops.linear, or run without --cuda-graphs")
        self.ops.append((name, signature(args)))

    def read(self) -> None:
        if self._kernels:                 # a kernel's reference, not the device kernel
            return
        raise CaptureError(f"{self.what} reads the device back (a sync) inside the captured "
                           "step, which a CUDA graph cannot hold: read after the step, or run "
                           "without --cuda-graphs")

    def upload(self) -> None:
        if self._kernels:
            return
        raise CaptureError(f"{self.what} copies host data to the device inside the captured "
                           "step (a replay would copy the first step's data): write the "
                           "inputs into the step's buffers before it, or run without "
                           "--cuda-graphs")

    def first_difference(self, other: "Capture") -> str | None:
        """Where ``other`` (a replay) stops being this capture's computation, or None."""
        for i, (mine, theirs) in enumerate(zip(self.ops, other.ops)):
            if mine != theirs:
                return f"operation {i}: captured {_show(mine)}, now {_show(theirs)}"
        if len(self.ops) != len(other.ops):
            return f"captured {len(self.ops)} operations, now {len(other.ops)}"
        return None


@contextmanager
def active(capture: Capture):
    """Check and record the block's array operations (one capture at a time)."""
    global _active
    if _active is not None:
        raise RuntimeError("a step is already being captured")
    _active = capture
    try:
        yield capture
    finally:
        _active = None


@contextmanager
def kernel(name: str, args):
    """The block is one device kernel ``name`` on ``args`` (``ops.counted``): its launch is
    recorded, and what its NumPy reference does inside (products, a read of the tiles to
    skip, a constant copied in) is the kernel's own work on the device, which capture
    accepts (cuDNN's attention, the planned GEMM)."""
    if _active is None:
        yield
        return
    _active.record(f"kernel {name}", args)
    _active._kernels += 1
    try:
        yield
    finally:
        _active._kernels -= 1


def signature(value):
    """What a replay must repeat of an operation's arguments: arrays by shape and dtype,
    host values as they are."""
    if isinstance(value, (type, np.dtype)):
        return str(value)
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype") and not isinstance(value, np.generic):
        return ("array", tuple(shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), signature(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(
            signature(getattr(value, f.name)) for f in dataclasses.fields(value))
    if value is None or isinstance(value, (bool, int, float, complex, str, np.generic)):
        return repr(value)
    return type(value).__name__


def _show(op: tuple) -> str:
    name, args = op
    text = f"{name}{args}"
    return text if len(text) < 160 else text[:157] + "..."
