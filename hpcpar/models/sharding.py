"""How every tensor of a checkpoint is split over a tensor-parallel group, in the core's
placements (``hpcpar.parallel.tensor.placement``; pure math).

Megatron's plan, on Hugging Face ``[out, in]`` weights:

    q, k, v, gate, up   column-parallel, ``Shard(0)``: output features; q by whole heads,
                        k/v by whole KV heads (``unit=head_dim``), each KV head replicated on
                        tp/kv_heads ranks when kv_heads < tp; q/k norms over the whole
                        projection (OLMo 2) as q and k
    o, down             row-parallel, ``Shard(1)``: input features; o by whole heads
    q_b, kv_b           latent attention's expansions into heads: column-parallel by whole
                        heads; its latents' projections (q_a, kv_a) and norms replicated
    embed, lm_head      vocab-parallel, ``Shard(0, padded=True)``: the vocabulary in blocks of
                        ceil(V / tp), padded with zero rows so every rank holds the same shape
    norms, o/down bias  ``Replicate()`` (a row-parallel bias is added once, after the AllReduce)

``piece_of`` says which region of the full tensor a (tp_rank, tp_size) holds and where it lands
in the local buffer; ``split`` and ``merge`` are exact inverses built on it.
"""

from __future__ import annotations

import numpy as np

from ..parallel.tensor.placement import Piece, Replicate, Shard
from ..parallel.tensor.splits import (ShardingError, padded_vocab_size, unit_split_problem,
                                      vocab_range)
from .config import ModelConfig
from .tensors import TensorSpec

__all__ = ["PLACEMENT_OF_ROLE", "Piece", "ShardingError", "merge", "padded_vocab_size",
           "piece_of", "placement_of", "split", "vocab_range"]

COLUMN, ROW, VOCAB, REPLICATED = Shard(0), Shard(1), Shard(0, padded=True), Replicate()

PLACEMENT_OF_ROLE = {
    "embed": VOCAB, "head": VOCAB,
    "q": COLUMN, "k": COLUMN, "v": COLUMN,
    "q_bias": COLUMN, "k_bias": COLUMN, "v_bias": COLUMN,
    "gate": COLUMN, "up": COLUMN, "gate_bias": COLUMN, "up_bias": COLUMN,
    "o": ROW, "down": ROW,
    "o_bias": REPLICATED, "down_bias": REPLICATED,
    "input_norm": REPLICATED, "post_attention_norm": REPLICATED,
    "attn_out_norm": REPLICATED, "mlp_out_norm": REPLICATED,     # norms of a block's output
    "q_norm": REPLICATED, "k_norm": REPLICATED,      # one weight for every head (over the
                                                     # whole projection: ``WHOLE_NORMS``)
    # a mixture of experts: every expert split as the dense MLP is, the router replicated
    "router": REPLICATED, "shared_expert_gate": REPLICATED,
    "expert_gate": COLUMN, "expert_up": COLUMN, "expert_down": ROW,
    "shared_gate": COLUMN, "shared_up": COLUMN, "shared_down": ROW,
    "router_bias": REPLICATED,
    # latent attention: the latents' projections and norms on every rank, the expansions
    # into heads (q_b, kv_b) by whole heads as q is
    "q_a": REPLICATED, "q_a_norm": REPLICATED, "kv_a": REPLICATED, "kv_a_norm": REPLICATED,
    "q_b": COLUMN, "kv_b": COLUMN,
    "fused": COLUMN,      # a stored fused tensor, whole (its parts are split each)
    "final_norm": REPLICATED,
}

HEADS = ("q", "q_bias", "o", "q_b", "kv_b")   # whole attention heads, never replicated
KV_HEADS = ("k", "v", "k_bias", "v_bias")     # whole KV heads, replicated when kv_heads < tp
WHOLE_NORMS = ("q_norm", "k_norm")            # over the whole projection: cut as q and k are


def kv_head_role(spec: TensorSpec, cfg: ModelConfig) -> bool:
    """Whether ``spec`` is cut by KV heads (replicated when kv_heads < tp): k, v, their
    biases, and a k norm over the whole projection (OLMo 2's)."""
    return spec.role in KV_HEADS or (cfg.qk_norm_whole and spec.role == "k_norm")


def placement_of(spec: TensorSpec, cfg: ModelConfig) -> Shard | Replicate:
    """How ``spec`` lies over tp: its role's placement, cut by whole heads for attention's
    projections (and for q/k norms over the whole projection, which are split as q and k)."""
    if cfg.qk_norm_whole and spec.role in WHOLE_NORMS:
        return Shard(0, unit=cfg.head_dim)
    placement = PLACEMENT_OF_ROLE[spec.role]
    if spec.role in HEADS or spec.role in KV_HEADS:
        return Shard(placement.dim, unit=head_unit(spec.role, cfg))
    return placement


def head_unit(role: str, cfg: ModelConfig) -> int:
    """A head's rows (columns of o) in the tensor of ``role``: head_dim, or latent
    attention's q/k head, v head, and the pair of k's unturned part and v (kv_b)."""
    if not cfg.mla:
        return cfg.head_dim
    return {"o": cfg.v_head_dim,
            "kv_b": cfg.qk_nope_head_dim + cfg.v_head_dim}.get(role, cfg.qk_head_dim)


def piece_of(spec: TensorSpec, cfg: ModelConfig, tp_rank: int, tp_size: int) -> Piece:
    """The piece of ``spec`` that tensor-parallel rank ``tp_rank`` of ``tp_size`` holds."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp size {tp_size}")
    placement = placement_of(spec, cfg)
    if tp_size > 1 and isinstance(placement, Shard) and not placement.padded:
        units = spec.shape[placement.dim] // placement.unit
        if unit_split_problem(units, tp_size, kv_head_role(spec, cfg)) is not None:
            what = ("heads" if placement.unit > 1
                    else "rows" if placement.dim == 0 else "columns")
            raise ShardingError(
                f"{spec.name}: {units} {what} cannot be split evenly over tp {tp_size}; "
                f"choose a tp that divides {units}")
    return placement.piece(spec.shape, tp_rank, tp_size)


def split(full: np.ndarray, spec: TensorSpec, cfg: ModelConfig, tp_size: int) -> list[np.ndarray]:
    """Every rank's piece of ``full``, in tp-rank order (vocabulary padding is zero)."""
    if tuple(full.shape) != spec.shape:
        raise ShardingError(f"{spec.name}: array of shape {tuple(full.shape)} is not the "
                            f"expected {spec.shape}")
    out = []
    for r in range(tp_size):
        piece = piece_of(spec, cfg, r, tp_size)
        local = np.zeros(piece.shape, dtype=full.dtype)
        local[piece.dest] = full[piece.source]
        out.append(local)
    return out


def merge(shards: list[np.ndarray], spec: TensorSpec, cfg: ModelConfig) -> np.ndarray:
    """The full tensor from every rank's piece (inverse of ``split``)."""
    tp_size = len(shards)
    full = np.empty(spec.shape, dtype=shards[0].dtype)
    for r, local in enumerate(shards):
        piece = piece_of(spec, cfg, r, tp_size)
        if tuple(local.shape) != piece.shape:
            raise ShardingError(f"{spec.name}: piece {r} has shape {tuple(local.shape)}, "
                                f"expected {piece.shape} for tp {tp_size}")
        full[piece.source] = local[piece.dest]  # replicated pieces write the same values again
    return full
