"""Trainable parameters of any model, and where the backward puts their gradients.

A ``Parameter`` is this rank's piece of a weight: ``data`` (what the layers read),
``grad`` (summed over micro-batches, then over data-parallel replicas), and the facts an
optimizer and a gradient norm need: ``decay`` (weight decay applies: matrices, not norms
or biases), ``counted`` (this rank's elements count in the global gradient norm: a weight
replicated over a tp group is counted on one rank of it), and ``master`` (the float32
weights the optimizer updates; ``data`` itself unless computing in 16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(eq=False)
class Parameter:
    data: object
    grad: object = None          # default: zeros, float32 at least
    name: str = ""
    decay: bool = True
    counted: bool = True
    master: object = None        # default: ``data``

    def __post_init__(self):
        if self.master is None:
            self.master = self.data
        if self.grad is None:
            dtype = self.master.dtype if self.master.dtype.itemsize >= 4 else np.float32
            self.grad = np.zeros_like(self.master, dtype=dtype)

    def zero_grad(self) -> None:
        self.grad[...] = 0

    def refresh(self) -> None:
        """Copy the updated master weights into the compute copy."""
        if self.data is not self.master:
            self.data[...] = self.master


class GradSink:
    """Where weight gradients go: added at once, or (``defer``) kept as closures until
    ``flush`` — zero-bubble schedules run a backward's input half (I) first and its weight
    half (W) later, in a pipeline bubble."""

    def __init__(self, xp, defer: bool = False):
        self.xp = xp
        self.defer = defer
        self.pending: list[tuple[Parameter | None, Callable]] = []

    def add(self, param: Parameter, grad: Callable[[], object]) -> None:
        """param.grad += grad()"""
        if self.defer:
            self.pending.append((param, grad))
        else:
            param.grad += grad()

    def outer(self, param: Parameter, dy2, x2) -> None:
        """param.grad += dy2^T x2, the weight gradient of Y = X W^T: (out, in) from
        dy2 (N, out) and x2 (N, in)."""
        self.add(param, lambda: dy2.T @ x2)

    def scatter_rows(self, param: Parameter, rows, values) -> None:
        """param.grad[rows[j]] += values[j] for every j, repeated rows summed."""
        def scatter():   # ufunc.at: NumPy, and CuPy >= 12 (atomicAdd, float32 grads)
            self.xp.add.at(param.grad, rows, values.astype(param.grad.dtype, copy=False))
        if self.defer:
            self.pending.append((None, scatter))
        else:
            scatter()

    def flush(self) -> None:
        for param, grad in self.pending:
            if param is None:
                grad()                   # an in-place update (scatter_rows)
            else:
                param.grad += grad()
        self.pending.clear()
