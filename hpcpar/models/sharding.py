"""How every tensor of a checkpoint is split over a tensor-parallel group (pure math).

Megatron's plan, on Hugging Face ``[out, in]`` weights:

    q, k, v, gate, up   column-parallel: split dim 0 (output features) - q by whole heads,
                        k/v by whole KV heads, each KV head replicated on tp/kv_heads ranks
                        when kv_heads < tp
    o, down             row-parallel: split dim 1 (input features) - o by whole heads
    embed, lm_head      vocab-parallel: split dim 0 (vocabulary), padded with zero rows up to
                        a multiple of tp so every rank holds the same shape
    norms, o/down bias  replicated (a row-parallel bias is added once, after the AllReduce)

``shard_of`` says which region of the full tensor a (tp_rank, tp_size) holds and where it lands
in the local buffer; ``split`` and ``merge`` are exact inverses built on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..parallel.tensor import splits as core_split
from ..parallel.tensor.splits import ShardingError, padded_vocab_size, vocab_range
from .config import ModelConfig
from .tensors import TensorSpec


class Split(Enum):
    REPLICATED = "replicated"
    COLUMN = "column"      # dim 0 of [out, in]: output features
    ROW = "row"            # dim 1 of [out, in]: input features
    VOCAB = "vocab"        # dim 0, vocabulary padded up to a multiple of tp


SPLIT_OF_ROLE = {
    "embed": Split.VOCAB, "head": Split.VOCAB,
    "q": Split.COLUMN, "k": Split.COLUMN, "v": Split.COLUMN,
    "q_bias": Split.COLUMN, "k_bias": Split.COLUMN, "v_bias": Split.COLUMN,
    "gate": Split.COLUMN, "up": Split.COLUMN, "gate_bias": Split.COLUMN,
    "up_bias": Split.COLUMN,
    "o": Split.ROW, "down": Split.ROW,
    "o_bias": Split.REPLICATED, "down_bias": Split.REPLICATED,
    "input_norm": Split.REPLICATED, "post_attention_norm": Split.REPLICATED,
    "q_norm": Split.REPLICATED, "k_norm": Split.REPLICATED,      # one weight for every head
    # a mixture of experts: every expert split as the dense MLP is, the router replicated
    "router": Split.REPLICATED, "shared_expert_gate": Split.REPLICATED,
    "expert_gate": Split.COLUMN, "expert_up": Split.COLUMN, "expert_down": Split.ROW,
    "shared_gate": Split.COLUMN, "shared_up": Split.COLUMN, "shared_down": Split.ROW,
    "fused": Split.COLUMN,      # a stored fused tensor, whole (its parts are split each)
    "final_norm": Split.REPLICATED,
}

_AXIS = {Split.COLUMN: 0, Split.ROW: 1, Split.VOCAB: 0}


@dataclass(frozen=True)
class Shard:
    """One rank's piece of a tensor.

    ``source`` is the region of the full tensor; ``shape`` the local buffer's shape; ``dest``
    the region of the local buffer that ``source`` fills (the rest is vocabulary padding,
    zero)."""

    shape: tuple[int, ...]
    source: tuple[slice, ...]
    dest: tuple[slice, ...]

    @property
    def source_numel(self) -> int:
        return int(np.prod([s.stop - s.start for s in self.source], dtype=np.int64))


def split_of(spec: TensorSpec) -> Split:
    return SPLIT_OF_ROLE[spec.role]


def _units(spec: TensorSpec, cfg: ModelConfig) -> tuple[int, int, bool]:
    """(number of indivisible units, elements per unit, may replicate) along the split axis."""
    if spec.role in ("q", "q_bias", "o"):
        return cfg.num_attention_heads, cfg.head_dim, False
    if spec.role in ("k", "v", "k_bias", "v_bias"):
        return cfg.num_key_value_heads, cfg.head_dim, True
    axis = _AXIS[split_of(spec)]
    return spec.shape[axis], 1, False


def shard_of(spec: TensorSpec, cfg: ModelConfig, tp_rank: int, tp_size: int) -> Shard:
    """The piece of ``spec`` that tensor-parallel rank ``tp_rank`` of ``tp_size`` holds."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp size {tp_size}")
    full = tuple(slice(0, d) for d in spec.shape)
    split = split_of(spec)
    if split is Split.REPLICATED or tp_size == 1:
        return Shard(spec.shape, full, full)
    axis = _AXIS[split]
    if split is Split.VOCAB:
        per = padded_vocab_size(spec.shape[0], tp_size) // tp_size
        start, stop = vocab_range(spec.shape[0], tp_rank, tp_size)
        shape = (per,) + spec.shape[1:]
        return Shard(shape, (slice(start, stop),) + full[1:],
                     (slice(0, stop - start),) + full[1:])
    n_units, unit, may_replicate = _units(spec, cfg)
    # the core's unit rule: whole heads, a KV head replicated when kv_heads < tp
    if core_split.unit_split_problem(n_units, tp_size, may_replicate) is not None:
        what = "heads" if unit > 1 else ("rows" if axis == 0 else "columns")
        raise ShardingError(
            f"{spec.name}: {n_units} {what} cannot be split evenly over tp {tp_size}; "
            f"choose a tp that divides {n_units}")
    start, stop = core_split.bounds(n_units * unit, tp_size, unit=unit)[tp_rank]
    region = list(full)
    region[axis] = slice(start, stop)
    shape = list(spec.shape)
    shape[axis] = stop - start
    dest = tuple(slice(0, d) for d in shape)
    return Shard(tuple(shape), tuple(region), dest)


def split(full: np.ndarray, spec: TensorSpec, cfg: ModelConfig, tp_size: int) -> list[np.ndarray]:
    """Every rank's piece of ``full``, in tp-rank order (vocabulary padding is zero)."""
    if tuple(full.shape) != spec.shape:
        raise ShardingError(f"{spec.name}: array of shape {tuple(full.shape)} is not the "
                            f"expected {spec.shape}")
    out = []
    for r in range(tp_size):
        s = shard_of(spec, cfg, r, tp_size)
        local = np.zeros(s.shape, dtype=full.dtype)
        local[s.dest] = full[s.source]
        out.append(local)
    return out


def merge(shards: list[np.ndarray], spec: TensorSpec, cfg: ModelConfig) -> np.ndarray:
    """The full tensor from every rank's piece (inverse of ``split``)."""
    tp_size = len(shards)
    full = np.empty(spec.shape, dtype=shards[0].dtype)
    for r, local in enumerate(shards):
        s = shard_of(spec, cfg, r, tp_size)
        if tuple(local.shape) != s.shape:
            raise ShardingError(f"{spec.name}: piece {r} has shape {tuple(local.shape)}, "
                                f"expected {s.shape} for tp {tp_size}")
        full[s.source] = local[s.dest]  # replicated pieces write the same values again
    return full
