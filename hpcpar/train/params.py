"""Trainable parameters: one rank's shard of each Hugging Face tensor, its gradient, and the
two facts the optimizer needs about it.

A ``Param`` holds the shard in Hugging Face's orientation ([out, in] for linear weights), as
``sharding.shard_of`` cuts it: ``master`` in float32, which the optimizer updates and
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
from typing import Callable

from ..config import LlamaConfig
from ..sharding import Split, split_of
from ..tensors import EMBED, TensorSpec


@dataclass(eq=False)
class Param:
    spec: TensorSpec
    data: object            # this rank's shard in the compute dtype (what the layers read)
    grad: object            # float32, same shape; summed over micro-batches, then over dp
    counted: bool           # this rank's elements count in the global gradient norm
    decay: bool             # weight decay applies: matrices, not norm weights or biases
    kv_replicated: bool     # a KV head shared by several tp ranks: grads summed over them
    master: object = None   # float32 weights (``data`` itself when computing in float32)

    def __post_init__(self):
        if self.master is None:
            self.master = self.data

    @property
    def name(self) -> str:
        return self.spec.name

    def refresh(self) -> None:
        """Copy the updated master weights into the compute copy."""
        if self.data is not self.master:
            self.data[...] = self.master


def kv_replicas(cfg: LlamaConfig, tp_size: int) -> int:
    """How many tp ranks hold each KV head (1 unless kv_heads < tp)."""
    kv = cfg.num_key_value_heads
    return tp_size // kv if kv < tp_size else 1


def make_param(spec: TensorSpec, master, xp, cfg: LlamaConfig, tp_rank: int, tp_size: int,
               last_stage_tied_copy: bool = False, dtype=None) -> Param:
    """A param of float32 ``master`` weights, computing in ``dtype`` (default: float32)."""
    split = split_of(spec)
    replicas = kv_replicas(cfg, tp_size) if spec.role in ("k", "v", "k_bias", "v_bias") else 1
    if split is Split.REPLICATED:
        counted = tp_rank == 0
    else:
        counted = tp_rank % replicas == 0
    if last_stage_tied_copy and spec.name == EMBED:
        counted = False
    data = master if dtype is None or master.dtype == dtype else master.astype(dtype)
    return Param(spec, data, xp.zeros_like(master), counted, len(spec.shape) == 2,
                 replicas > 1, master)


class GradSink:
    """Where weight gradients go: added at once, or (``defer``) kept as closures until
    ``flush`` — zero-bubble schedules run a backward's input half (B) first and its weight
    half (W) later, in a pipeline bubble."""

    def __init__(self, xp, defer: bool = False):
        self.xp = xp
        self.defer = defer
        self.pending: list[tuple[Param, Callable]] = []

    def add(self, param: Param, grad: Callable[[], object]) -> None:
        """param.grad += grad()"""
        if self.defer:
            self.pending.append((param, grad))
        else:
            param.grad += grad()

    def outer(self, param: Param, dy2, x2) -> None:
        """param.grad += dy2^T x2, the weight gradient of Y = X W^T: (out, in) from
        dy2 (N, out) and x2 (N, in)."""
        self.add(param, lambda: dy2.T @ x2)

    def scatter_rows(self, param: Param, rows, values) -> None:
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


def make_params(cfg: LlamaConfig, specs: list[TensorSpec], shards: dict, xp, tp_rank: int,
                tp_size: int, last_stage_tied_copy: bool = False,
                dtype=None) -> dict[str, Param]:
    """Params for ``specs`` from this rank's shards (name -> xp array, already sliced)."""
    return {s.name: make_param(s, shards[s.name], xp, cfg, tp_rank, tp_size,
                               last_stage_tied_copy, dtype) for s in specs}
