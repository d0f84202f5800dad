"""The Llama decoder as one pipeline stage on one tensor-parallel rank.

    x = embed(ids)                                    first stage only
    for each layer of this stage:
        x = x + o_proj(attention(rope(q, k), v))      over rms_norm(x)
        x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),  h = rms_norm(x)
    logits = lm_head(rms_norm(x))                     last stage only

This is Hugging Face's ``LlamaForCausalLM`` exactly, split by ``hpcpar.sharding``: two
AllReduces per layer over tp (o_proj, down_proj), one for the embedding, none for the head.
With tied embeddings the last stage's head is its own copy of the embedding slice.
"""

from __future__ import annotations

from ..comm import Communicator
from ..config import LlamaConfig
from ..tensors import TensorSpec
from .attention import Attention, attention_mask
from .kv_cache import KVCache
from .parallel_layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                              VocabParallelEmbedding)
from .rope import RotaryEmbedding


def rms_norm(x, weight, eps: float, xp):
    """weight * x / sqrt(mean(x^2) + eps), the statistics in float32 as transformers does."""
    h = x.astype(xp.float32)
    h = h / xp.sqrt((h * h).mean(axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype, copy=False)


class Mlp:
    """down(silu(gate(x)) * up(x)); gate/up column-parallel as one GEMM, down row-parallel.
    Communication: one AllReduce forward (in down), one backward (after gate/up)."""

    def __init__(self, xp, gate_up: ColumnParallelLinear, down: RowParallelLinear):
        self.xp, self.gate_up, self.down = xp, gate_up, down

    def __call__(self, x):
        gate, up = self.gate_up(x)
        return self.down(gate / (1 + self.xp.exp(-gate)) * up)


class DecoderLayer:
    def __init__(self, cfg: LlamaConfig, w: dict, tp: Communicator, xp):
        heads = cfg.num_attention_heads // tp.size
        kv_heads = w["k"].shape[0] // cfg.head_dim
        bias = cfg.attention_bias
        qkv = ColumnParallelLinear(xp, [w["q"], w["k"], w["v"]],
                                   [w["q_bias"], w["k_bias"], w["v_bias"]] if bias else None)
        o = RowParallelLinear(xp, w["o"], w.get("o_bias"), tp)
        self.attention = Attention(xp, heads, kv_heads, cfg.head_dim, qkv, o)
        mlp_bias = [w["gate_bias"], w["up_bias"]] if cfg.mlp_bias else None
        self.mlp = Mlp(xp, ColumnParallelLinear(xp, [w["gate"], w["up"]], mlp_bias),
                       RowParallelLinear(xp, w["down"], w.get("down_bias"), tp))
        self.input_norm, self.post_norm = w["input_norm"], w["post_attention_norm"]
        self.eps = cfg.rms_norm_eps
        self.xp = xp

    def __call__(self, x, cos, sin, mask, cache: KVCache, layer: int, slot: int):
        xp = self.xp
        x = x + self.attention(rms_norm(x, self.input_norm, self.eps, xp), cos, sin, mask,
                               cache, layer, slot)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps, xp))


class LlamaStage:
    """The layers ``layers`` of the model on this (pp, tp) rank, plus the embedding on the
    first stage and the final norm and head on the last.

    ``weights`` maps Hugging Face tensor names to this rank's slices, as ``load_shard``
    returns them (the stage takes them out of it); ``specs`` are the matching ``TensorSpec``s.
    """

    def __init__(self, cfg: LlamaConfig, specs: list[TensorSpec], weights: dict,
                 layers: range, first: bool, last: bool, tp: Communicator, xp, dtype):
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        self.xp, self.dtype, self.tp = xp, dtype, tp
        by_layer: dict[int | None, dict] = {}
        # taken out of ``weights``: the layers keep one (transposed) copy of each tensor and
        # the original is freed, so the device holds each weight once (plus one layer's
        # while building)
        for spec in specs:
            by_layer.setdefault(spec.layer, {})[spec.role] = weights.pop(spec.name).astype(
                dtype, copy=False)
        self.weight_bytes = sum(a.nbytes for group in by_layer.values() for a in group.values())
        top = by_layer.get(None, {})
        self.embedding = (VocabParallelEmbedding(xp, top["embed"], cfg.vocab_size, tp)
                          if first else None)
        self.decoder = [DecoderLayer(cfg, by_layer[i], tp, xp) for i in layers]
        if last:
            self.final_norm = top["final_norm"]
            head = top["embed"] if cfg.tie_word_embeddings else top["head"]
            self.head = ParallelLMHead(xp, head, cfg.vocab_size, tp,
                                       shared=first and cfg.tie_word_embeddings)
        self.rope = RotaryEmbedding(cfg, xp, dtype)
        self.hidden_size = cfg.hidden_size

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """This stage's KV cache for a micro-batch of ``batch`` rows and ``capacity`` slots."""
        kv_heads = self.decoder[0].attention.kv_heads
        return KVCache(self.xp, len(self.decoder), batch, kv_heads, capacity,
                       self.cfg.head_dim, self.dtype)

    def embed(self, ids):
        """(B, T) token ids -> (B, T, hidden) (first stage)."""
        return self.embedding(ids)

    def forward(self, x, pad, slot: int, cache: KVCache):
        """Run this stage's layers on x (B, T, hidden), whose tokens sit in cache slots
        [slot, slot + T); ``pad`` (B,) is each row's left padding."""
        xp = self.xp
        B, T, _ = x.shape
        positions = xp.maximum(slot + xp.arange(T)[None, :] - pad[:, None], 0)   # (B, T)
        cos, sin = self.rope.tables(positions)
        mask = attention_mask(xp, pad, slot, T)
        for i, layer in enumerate(self.decoder):
            x = layer(x, cos, sin, mask, cache, i, slot)
        return x

    def logits(self, x):
        """(B, T, hidden) -> this rank's (B, T, vocab_per_partition) float32 logits (last)."""
        h = rms_norm(x, self.final_norm, self.cfg.rms_norm_eps, self.xp)
        return self.head.local_logits(h)
