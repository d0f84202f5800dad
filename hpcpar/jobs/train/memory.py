"""Training memory per rank, from the config alone (for ``hpcpar plan``): the activations a
forward pass keeps for its backward, and the weights, gradients and optimizer state.

The activation count mirrors what the model's layers keep in training with the ops' NumPy references
(float32, per tp rank), for one micro-batch of B rows of T tokens:

    per layer   B T (4 h + 2 + 3 q + 2 kv + 3 I) + B nh T          (nh, q, kv, I per rank)
                - with recompute, only the layer's input: B T h
                (tiled attention keeps its output and the softmax statistics, lse, B nh T,
                not the B nh T^2 probabilities)
    per chunk   rotary tables 2 B T d
    first       ids and their owner mask: 9 B T bytes
    last        final norm B T (h + 1), head input B T h, loss B T V/p (+ 21 B T bytes of
                sums, targets and weights)

A schedule multiplies this by the micro-batches a stage holds at its peak
(``peak_activations_formula``).
"""

from __future__ import annotations

from ...models.config import ModelConfig
from ...models.sharding import padded_vocab_size, piece_of
from ...models.tensors import layer_tensors

FLOAT = 4


def activation_bytes(cfg: ModelConfig, tp: int, num_layers: int, rows: int, seq_len: int,
                     first: bool, last: bool, recompute: bool, itemsize: int = FLOAT) -> int:
    """Bytes one chunk keeps for one micro-batch between its forward and backward (exact in
    float32; with 16-bit compute, ``itemsize`` 2 approximates it)."""
    B, T, h = rows, seq_len, cfg.hidden_size
    k_proj = next(s for s in layer_tensors(cfg, 0) if s.role == "k")
    kv = piece_of(k_proj, cfg, 0, tp).shape[0]                   # kv_heads * head_dim per rank
    heads = cfg.num_attention_heads // tp
    q = heads * cfg.head_dim
    inter = cfg.intermediate_size // tp
    # a MoE layer keeps, per token, its k rows at the experts (input, gate, up, activation)
    # and back (outputs), the routing (float32 probabilities, int64 choices and order)
    k, moe_inter = cfg.experts_per_token, cfg.moe_intermediate_size // tp
    moe_share = len(cfg.moe_layers) / cfg.num_hidden_layers
    mlp = ((1 - moe_share) * 3 * inter + moe_share * k * (2 * h + 3 * moe_inter)) * itemsize \
        + moe_share * (4 * cfg.num_experts + 24 * k)
    if recompute:
        per_layer = B * T * h * itemsize
    else:
        per_layer = int(B * T * ((4 * h + 2 + 3 * q + 2 * kv) * itemsize + mlp)
                        + B * heads * T * itemsize)
    total = num_layers * per_layer + 2 * B * T * cfg.head_dim * itemsize
    if first:
        total += 9 * B * T
    if last:
        vocab = padded_vocab_size(cfg.vocab_size, tp) // tp
        total += (2 * B * T * h + B * T + B * T * vocab) * FLOAT + 21 * B * T
    return total


def state_bytes(param_count: int, optimizer: str) -> dict[str, int]:
    """float32 master weights, their gradients and the optimizer's state for this many
    parameters (AdamW two moments, SGD one momentum buffer)."""
    states = 2 if optimizer == "adamw" else 1
    return {"weights": param_count * FLOAT, "gradients": param_count * FLOAT,
            "optimizer": states * param_count * FLOAT}
