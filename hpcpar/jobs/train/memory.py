"""Training memory per rank, from the config alone (for ``hpcpar plan``): the activations a
forward pass keeps for its backward, and the weights, gradients and optimizer state.

The activation count mirrors what the model's layers keep in training with the ops' NumPy references
(float32, per tp rank), for one micro-batch of B rows of T tokens:

    per layer   B T (4 h + 2 + 3 q + 2 kv + 3 I) + B nh T          (nh, q, kv, I per rank)
                + B T (q + kv + nh + nkv) with per-head q/k norms (their inputs, statistics)
                - with recompute, only the layer's input: B T h
                (tiled attention keeps its output and the softmax statistics, lse, B nh T,
                not the B nh T^2 probabilities)
    per chunk   rotary tables 2 B T d
    first       ids and their owner mask: 9 B T bytes
    last        final norm B T (h + 1), head input B T h, loss B T V/p (+ 21 B T bytes of
                sums, targets and weights)

Under sequence parallelism the activations outside the tp pairs are kept split along the
sequence, S = T / p positions per rank: the norms' inputs and statistics and the pairs'
inputs, B S (4 h + 2) of each layer (the pairs gather theirs again in backward), a
recomputed layer's input B S h, the final norm and the head's input B S (2 h + 1); what lies
inside the pairs (q, k, v, attention, the MLP's, a MoE layer's rows) is every position's.

A schedule multiplies this by the micro-batches a stage holds at its peak
(``peak_activations_formula``).
"""

from __future__ import annotations

from ...models.config import ModelConfig
from ...models.sharding import padded_vocab_size, piece_of
from ...models.tensors import layer_tensors

FLOAT = 4


def activation_bytes(cfg: ModelConfig, tp: int, num_layers: int, rows: int, seq_len: int,
                     first: bool, last: bool, recompute: bool, itemsize: int = FLOAT,
                     sequence_parallel: bool = False) -> int:
    """Bytes one chunk keeps for one micro-batch between its forward and backward (exact in
    float32; with 16-bit compute, ``itemsize`` 2 approximates it). ``seq_len``: the positions
    of a row on this rank (its cp shard's)."""
    B, T, h = rows, seq_len, cfg.hidden_size
    S = T // tp if sequence_parallel else T         # positions of the split activations
    heads = cfg.num_attention_heads // tp
    if cfg.mla:     # latent attention trains expanded: every head's q, k, v of one width
        q = kv = heads * max(cfg.qk_head_dim, cfg.v_head_dim)
    else:
        k_proj = next(s for s in layer_tensors(cfg, 0) if s.role == "k")
        kv = piece_of(k_proj, cfg, 0, tp).shape[0]               # kv_heads * head_dim per rank
        q = heads * cfg.head_dim
    inter = cfg.intermediate_size // tp
    # a MoE layer keeps, per token, its k rows at the experts (input, gate, up, activation)
    # and back (outputs), the routing (float32 probabilities, int64 choices and order)
    k, moe_inter = cfg.experts_per_token, cfg.moe_intermediate_size // tp
    moe_share = len(cfg.moe_layers) / cfg.num_hidden_layers
    mlp = ((1 - moe_share) * 3 * inter + moe_share * k * (2 * h + 3 * moe_inter)) * itemsize \
        + moe_share * (4 * cfg.num_experts + 24 * k)
    # per-head q/k norms keep their inputs and statistics (one per head)
    qk_norms = (q + kv + heads + kv // cfg.head_dim
                if cfg.qk_norm and not cfg.qk_norm_whole else 0)
    if recompute:
        per_layer = B * S * h * itemsize
    else:
        per_layer = B * S * (4 * h + 2) * itemsize + int(
            B * T * ((3 * q + 2 * kv + qk_norms) * itemsize + mlp) + B * heads * T * itemsize)
    total = num_layers * per_layer + 2 * B * T * cfg.head_dim * itemsize
    if first:
        total += 9 * B * T
    if last:
        vocab = padded_vocab_size(cfg.vocab_size, tp) // tp
        total += (B * S * (2 * h + 1) + B * T * vocab) * FLOAT + 21 * B * T
    return total


def state_bytes(param_count: int, optimizer: str) -> dict[str, int]:
    """float32 master weights, their gradients and the optimizer's state for this many
    parameters (AdamW two moments, SGD one momentum buffer)."""
    states = 2 if optimizer == "adamw" else 1
    return {"weights": param_count * FLOAT, "gradients": param_count * FLOAT,
            "optimizer": states * param_count * FLOAT}


def parameter_state_bytes(count: int, experts: int, holders: int, expert_holders: int,
                          zero: int, optimizer: str, itemsize: int = FLOAT) -> dict[str, int]:
    """Per rank, for ``count`` parameters (``experts`` of them an MoE's routed experts) held
    by ``holders`` ranks (the experts by ``expert_holders``), computing in ``itemsize``-byte
    floats, under ZeRO stage ``zero``: the bytes of ``weights``, ``gradients`` and
    ``optimizer`` state as ``weight_holders.held_bytes`` measures them.

        0  float32 masters (and a 16-bit compute copy), float32 gradients, the state
        1  as 0, with the state, a float32 copy of the weights and the summed gradients
           split over the holders
        2  the compute copy whole; the gradients, the state and the float32 weights split
           (in 16 bits with their 16-bit copy, which the gathers send)
        3  as 2, without the whole compute copy

    A group held by one rank is not split, whatever the stage."""
    states = 2 if optimizer == "adamw" else 1
    copy16 = itemsize if itemsize < FLOAT else 0
    out = {"weights": 0, "gradients": 0, "optimizer": 0}
    for n, h in ((count - experts, holders), (experts, expert_holders)):
        stage = zero if h > 1 else 0

        def split(per_param: int) -> int:
            return -(-n * per_param // h)
        out["weights"] += (n * (FLOAT + copy16) if stage < 2
                           else n * itemsize * (stage == 2) + split(copy16))
        # stage 1 sums each piece apart from the whole gradients
        out["gradients"] += (n * FLOAT + (split(FLOAT) if stage == 1 else 0) if stage < 2
                             else split(FLOAT))
        out["optimizer"] += (states * n * FLOAT if stage == 0
                             else split((states + 1) * FLOAT))
    return out


def optimizer_scratch_bytes(count: int, experts: int, holders: int, expert_holders: int,
                            zero: int, fused: bool) -> int:
    """A device's optimizer step (not ``fused``): one float32 scratch the size of the
    largest run of parameters this rank updates (the dense ones, or the experts, each
    split over their holders under ZeRO), made for the step (``optim.optimizers``)."""
    if fused:
        return 0
    updated = [n if (zero if h > 1 else 0) == 0 else -(-n // h)
               for n, h in ((count - experts, holders), (experts, expert_holders))]
    return max(updated) * FLOAT
