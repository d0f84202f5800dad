"""Trainable parameters: one rank's shard of each Hugging Face tensor, its gradient, and the
two facts the optimizer needs about it.

A ``Param`` holds the shard in Hugging Face's orientation ([out, in] for linear weights), as
``sharding.piece_of`` cuts it: ``master`` in float32, which the optimizer updates and
checkpoints store, and ``data`` in the compute dtype, which the layers read (the same array
when computing in float32; a copy refreshed after each step in bfloat16 or float16).
Gradients accumulate in float32. Which rank *counts* a tensor's
elements decides the global gradient norm, so it is decided here, once:

- tp-replicated tensors (norm weights, row-parallel biases) are identical on every tp rank:
  tp rank 0 counts them;
- a KV head replicated over tp/kv ranks (kv_heads < tp) is counted by the first of them;
- a tied embedding held by the first and the last pipeline stage is counted on the first;
- dp replicas are never summed in the norm (their gradients are equal after the reduction).

With ZeRO 2 and 3 an array the rank does not hold whole stands as ``NotHeld``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...models.config import ModelConfig
from ...models.decoder import SEQUENCE_SPLIT_ROLES
from ...models.lora import REPLICATED, AdapterSpec
from ...models.sharding import kv_head_role, placement_of
from ...models.tensors import EMBED, TensorSpec
from ...parallel.errors import HpcparError
from ...parallel.params import GradSink, Parameter
from ...parallel.tensor_parallel.layers import Frozen
from ...parallel.tensor.placement import Replicate
from ...parallel.tensor.splits import unit_replicas

PER_HEAD_NORMS = ("q_norm", "k_norm")       # one weight every head reads, heads split over tp

__all__ = ["FrozenParam", "GradSink", "NotHeld", "Param", "kv_replicas", "make_adapter_param",
           "make_param", "make_params"]


class NotHeld:
    """Where a parameter's full ``data`` or ``grad`` would be while ZeRO does not hold it:
    its shape and dtype, and an error naming it on any other use."""

    def __init__(self, what: str, name: str, shape: tuple, dtype):
        self._what, self._name = what, name
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize

    def __getattr__(self, attr):
        raise HpcparError(f"the {self._what} of {self._name!r} is split over the data-parallel "
                          f"replicas (--zero) and not gathered here: an internal error, please "
                          f"report it")

    def _refuse(self, *args, **kwargs):
        return self.__getattr__("use")

    __array__ = __iadd__ = __getitem__ = __setitem__ = __add__ = __mul__ = __matmul__ = _refuse


class Param(Parameter):
    """The core's ``Parameter`` of one Hugging Face tensor: ``spec`` names it, and
    ``kv_replicated`` says it is a KV head shared by several tp ranks (its gradients are
    summed over them)."""

    def __init__(self, spec: TensorSpec, data, grad, counted: bool, decay: bool,
                 kv_replicated: bool, master=None, tp_partial: bool = False):
        super().__init__(data, grad, spec.name, decay, counted, master)
        self.spec = spec
        self.kv_replicated = kv_replicated
        # each tp rank adds a part of the gradient, summed over tp: a per-head norm's weight,
        # a replicated LoRA half, a norm's under sequence parallelism
        self.tp_partial = tp_partial


@dataclass(eq=False)
class FrozenParam(Frozen):
    """A LoRA run's base tensor: this rank's shard in the compute dtype, no gradient, no
    optimizer state, no float32 copy; ``lora`` the adapter the layers add to it."""

    spec: TensorSpec | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def make_adapter_param(spec: AdapterSpec, master, xp, cfg: ModelConfig, tp_rank: int,
                       tp_size: int, dtype=None) -> Param:
    """A LoRA adapter's half as a param (float32 ``master``): the replicated half (A of a
    column-parallel base, B of a row-parallel one) counted on tp rank 0, its gradient a
    partial sum over tp (summed as a per-head norm's); B of a KV projection held by
    several tp ranks (kv_heads < tp) summed over them, as its base would be."""
    replicated = spec.role == REPLICATED
    replicas = kv_replicas(cfg, tp_size) if spec.role in ("k", "v") else 1
    counted = tp_rank == 0 if replicated else tp_rank % replicas == 0
    data = master if dtype is None or master.dtype == dtype else master.astype(dtype)
    return Param(spec, data, xp.zeros_like(master), counted, True, replicas > 1, master,
                 replicated and tp_size > 1)


def kv_replicas(cfg: ModelConfig, tp_size: int) -> int:
    """How many tp ranks hold each KV head (1 unless kv_heads < tp): the core's unit rule."""
    return unit_replicas(cfg.num_key_value_heads, tp_size)


def make_param(spec: TensorSpec, master, xp, cfg: ModelConfig, tp_rank: int, tp_size: int,
               last_stage_tied_copy: bool = False, dtype=None,
               sequence_parallel: bool = False) -> Param:
    """A param of float32 ``master`` weights, computing in ``dtype`` (default: float32).
    Under ``sequence_parallel`` the replicated weights that read split positions (norms)
    get a partial gradient on each tp rank, summed over tp as a per-head norm's."""
    replicated = isinstance(placement_of(spec, cfg), Replicate)
    replicas = kv_replicas(cfg, tp_size) if kv_head_role(spec, cfg) else 1
    if replicated:
        counted = tp_rank == 0
    else:
        counted = tp_rank % replicas == 0
    if last_stage_tied_copy and spec.name == EMBED:
        counted = False
    if isinstance(master, NotHeld):        # ZeRO-3 reads its pieces alone (sharded_units)
        data = NotHeld("weights", spec.name, master.shape, dtype or np.float32)
        grad = NotHeld("gradient", spec.name, master.shape, np.float32)
    else:
        data = master if dtype is None or master.dtype == dtype else master.astype(dtype)
        grad = xp.zeros_like(master)
    per_head = spec.role in PER_HEAD_NORMS and not cfg.qk_norm_whole
    split = sequence_parallel and spec.role in SEQUENCE_SPLIT_ROLES
    return Param(spec, data, grad, counted, len(spec.shape) == 2,
                 replicas > 1, master, (per_head or split) and tp_size > 1)


def make_params(cfg: ModelConfig, specs: list[TensorSpec], shards: dict, xp, tp_rank: int,
                tp_size: int, last_stage_tied_copy: bool = False,
                dtype=None, sequence_parallel: bool = False) -> dict[str, Param]:
    """Params for ``specs`` from this rank's shards (name -> xp array, already sliced)."""
    return {s.name: make_param(s, shards[s.name], xp, cfg, tp_rank, tp_size,
                               last_stage_tied_copy, dtype, sequence_parallel) for s in specs}
