"""Trainable parameters of any model, how a model's parameters are found and named, and where
the backward puts their gradients.

A ``Parameter`` is this rank's piece of a weight: ``data`` (what the layers read),
``grad`` (summed over micro-batches, then over data-parallel replicas), and the facts an
optimizer and a gradient norm need: ``decay`` (weight decay applies: matrices, not norms
or biases), ``replicas`` (the ranks that hold this same parameter apart from data
parallelism: a bias or norm weight replicated over a tp group, a KV head held by several tp
ranks under GQA; a tuple of groups for their product: an MoE router over ep and tp),
``counted`` (whether this rank's elements count in the global gradient
norm: by default, unless it is a replica other than the first), and ``master`` (the float32
weights the optimizer updates; ``data`` itself unless computing in 16 bits). An optimizer
keeps a parameter's state by the object itself, so two parameters never share it, whatever
their names. A ``GradientReducer`` and an optimizer move the arrays into their flat buffers
(``data_parallel.flat_buffers``) and rebind ``grad``, ``master`` and ``data`` to views of them: read
and write a parameter's arrays through it, in place.

``named_parameters(obj)`` finds every ``Parameter`` of a model the way torch's modules do,
by attribute path (``"mlp.up.weight"``, ``"layers.0.weight"``): hpcpar's layers and the
``Pipeline`` name their own; any other object is searched through its attributes, lists and
dicts. The names are what a checkpoint or an optimizer's ``state_dict`` uses.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(eq=False)
class Parameter:
    data: object
    grad: object = None          # default: zeros, float32 at least
    name: str = ""
    decay: bool = True
    counted: bool | None = None  # default: not a second copy (``replicas`` rank 0, or none)
    master: object = None        # default: ``data``
    replicas: object = None      # the Communicator of the ranks holding this same parameter
                                 # (or a tuple of them: their product)
    partial_grad: bool = False   # each replica's backward adds a part of the gradient
    # ``sum_partial_grads`` made the partial gradient whole since the last optimizer step
    partial_summed: bool = field(default=False, init=False, repr=False)
    # the GradientReducer that sums this gradient over dp (it sets itself)
    reducer: object = field(default=None, init=False, repr=False)
    # where grad / master / data lie in flat buffers: attr -> (``flat_buffers.Flat``, index), set by
    # whoever put them there (a GradientReducer, ZeRO's shards, an optimizer)
    homes: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if self.master is None:
            self.master = self.data
        if self.grad is None:
            dtype = self.master.dtype if self.master.dtype.itemsize >= 4 else np.float32
            self.grad = np.zeros_like(self.master, dtype=dtype)
        if self.counted is None:
            self.counted = all(g.rank == 0 for g in replica_groups(self))

    def zero_grad(self) -> None:
        self.grad[...] = 0
        if self.reducer is not None:
            self.reducer.step_begins()

    def refresh(self) -> None:
        """Copy the updated master weights into the compute copy."""
        if self.data is not self.master:
            self.data[...] = self.master


def replica_groups(p: Parameter) -> tuple:
    """The groups of ``p``'s ``replicas`` (none, one, or the factors of their product)."""
    if p.replicas is None:
        return ()
    return tuple(p.replicas) if isinstance(p.replicas, (tuple, list)) else (p.replicas,)


def named_parameters(obj, prefix: str = "") -> dict[str, Parameter]:
    """Every ``Parameter`` reachable from ``obj``, by attribute path under ``prefix``, each
    once (a tied weight under its first name). Objects with a ``named_parameters(prefix)``
    method (hpcpar's layers, ``Pipeline``) name their own; other objects are searched
    through their attributes, list items and dict values; hpcpar's other objects
    (communicators, meshes, optimizers) hold none."""
    out: dict[str, Parameter] = {}
    _collect(obj, prefix, out, set(), root=True)
    return out


def parameters(obj) -> list[Parameter]:
    """``named_parameters(obj)``'s parameters, in order."""
    return list(named_parameters(obj).values())


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, str, bytes, int, float, complex, bool)


def _collect(obj, name: str, out: dict, seen: set, root: bool = False) -> None:
    if isinstance(obj, Parameter):
        if id(obj) not in seen:
            seen.add(id(obj))
            out[name] = obj
        return
    if obj is None or isinstance(obj, _OPAQUE) or id(obj) in seen:
        return
    seen.add(id(obj))
    ours = type(obj).__module__.startswith("hpcpar.")
    own = getattr(obj, "named_parameters", None)
    if callable(own) and (ours or not root):   # a user's own method may call this on itself
        for key, p in own(name).items():
            _collect(p, key, out, seen)
        return
    if isinstance(obj, dict):
        items = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    elif ours:
        return                                  # hpcpar's own objects name theirs (above)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for key, value in items:
        _collect(value, join(name, key), out, seen)


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
