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
"""

from __future__ import annotations

from dataclasses import dataclass

from ...models.config import ModelConfig
from ...models.lora import REPLICATED, AdapterSpec
from ...models.sharding import kv_head_role, placement_of
from ...models.tensors import EMBED, TensorSpec
from ...parallel.params import GradSink, Parameter
from ...parallel.tensor_parallel.layers import Frozen
from ...parallel.tensor.placement import Replicate
from ...parallel.tensor.splits import unit_replicas

PER_HEAD_NORMS = ("q_norm", "k_norm")       # one weight every head reads, heads split over tp

__all__ = ["FrozenParam", "GradSink", "Param", "kv_replicas", "make_adapter_param",
           "make_param", "make_params"]


class Param(Parameter):
    """The core's ``Parameter`` of one Hugging Face tensor: ``spec`` names it, and
    ``kv_replicated`` says it is a KV head shared by several tp ranks (its gradients are
    summed over them)."""

    def __init__(self, spec: TensorSpec, data, grad, counted: bool, decay: bool,
                 kv_replicated: bool, master=None, tp_partial: bool = False):
        super().__init__(data, grad, spec.name, decay, counted, master)
        self.spec = spec
        self.kv_replicated = kv_replicated
        self.tp_partial = tp_partial     # a per-head norm's weight: summed over tp


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
               last_stage_tied_copy: bool = False, dtype=None) -> Param:
    """A param of float32 ``master`` weights, computing in ``dtype`` (default: float32)."""
    replicated = isinstance(placement_of(spec, cfg), Replicate)
    replicas = kv_replicas(cfg, tp_size) if kv_head_role(spec, cfg) else 1
    if replicated:
        counted = tp_rank == 0
    else:
        counted = tp_rank % replicas == 0
    if last_stage_tied_copy and spec.name == EMBED:
        counted = False
    data = master if dtype is None or master.dtype == dtype else master.astype(dtype)
    return Param(spec, data, xp.zeros_like(master), counted, len(spec.shape) == 2,
                 replicas > 1, master,
                 spec.role in PER_HEAD_NORMS and tp_size > 1 and not cfg.qk_norm_whole)


def make_params(cfg: ModelConfig, specs: list[TensorSpec], shards: dict, xp, tp_rank: int,
                tp_size: int, last_stage_tied_copy: bool = False,
                dtype=None) -> dict[str, Param]:
    """Params for ``specs`` from this rank's shards (name -> xp array, already sliced)."""
    return {s.name: make_param(s, shards[s.name], xp, cfg, tp_rank, tp_size,
                               last_stage_tied_copy, dtype) for s in specs}
