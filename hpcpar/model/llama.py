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
from ..ops import AttentionRows, Ops
from ..tensors import TensorSpec
from .attention import Attention
from .kv_cache import KVCache
from .parallel_layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                              VocabParallelEmbedding)
from .rope import RotaryEmbedding


class Mlp:
    """down(silu(gate(x)) * up(x)); gate/up column-parallel as one GEMM, down row-parallel.
    Communication: one AllReduce forward (in down), one backward (after gate/up)."""

    def __init__(self, ops: Ops, gate_up: ColumnParallelLinear, down: RowParallelLinear):
        self.ops, self.gate_up, self.down = ops, gate_up, down

    def __call__(self, x):
        gate, up = self.gate_up(x)
        return self.down(self.ops.swiglu.forward(gate, up))


class DecoderLayer:
    """h = x + attention(norm1(x));  y = h + mlp(norm2(h)), the residual adds fused into the
    next norm: the layer takes and returns (x, pending), pending being the branch output not
    yet added to the residual stream x (None before the first layer)."""

    def __init__(self, cfg: LlamaConfig, w: dict, tp: Communicator, ops: Ops):
        heads = cfg.num_attention_heads // tp.size
        kv_heads = w["k"].shape[0] // cfg.head_dim
        bias = cfg.attention_bias
        xp = ops.xp
        qkv = ColumnParallelLinear(xp, [w["q"], w["k"], w["v"]],
                                   [w["q_bias"], w["k_bias"], w["v_bias"]] if bias else None)
        o = RowParallelLinear(xp, w["o"], w.get("o_bias"), tp)
        self.attention = Attention(ops, heads, kv_heads, cfg.head_dim, qkv, o)
        mlp_bias = [w["gate_bias"], w["up_bias"]] if cfg.mlp_bias else None
        self.mlp = Mlp(ops, ColumnParallelLinear(xp, [w["gate"], w["up"]], mlp_bias),
                       RowParallelLinear(xp, w["down"], w.get("down_bias"), tp))
        self.input_norm, self.post_norm = w["input_norm"], w["post_attention_norm"]
        self.eps = cfg.rms_norm_eps
        self.norm = ops.rms_norm

    def __call__(self, x, pending, cos, sin, rows: AttentionRows, cache: KVCache, layer: int):
        h, x = self._norm(x, pending, self.input_norm)
        a = self.attention(h, cos, sin, rows, cache, layer)
        h, x = self.norm.add_forward(a, x, self.post_norm, self.eps)
        return x, self.mlp(h)

    def _norm(self, x, pending, w):
        if pending is None:
            return self.norm.forward(x, w, self.eps), x
        return self.norm.add_forward(pending, x, w, self.eps)


class LlamaStage:
    """The layers ``layers`` of the model on this (pp, tp) rank, plus the embedding on the
    first stage and the final norm and head on the last.

    ``weights`` maps Hugging Face tensor names to this rank's slices, as ``load_shard``
    returns them (the stage takes them out of it); ``specs`` are the matching ``TensorSpec``s.
    """

    def __init__(self, cfg: LlamaConfig, specs: list[TensorSpec], weights: dict,
                 layers: range, first: bool, last: bool, tp: Communicator, ops: Ops, dtype):
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        xp = ops.xp
        self.ops, self.xp, self.dtype, self.tp = ops, xp, dtype, tp
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
        self.decoder = [DecoderLayer(cfg, by_layer[i], tp, ops) for i in layers]
        if last:
            self.final_norm = top["final_norm"]
            head = top["embed"] if cfg.tie_word_embeddings else top["head"]
            self.head = ParallelLMHead(ops, head, cfg.vocab_size, tp,
                                       shared=first and cfg.tie_word_embeddings)
        self.rope = RotaryEmbedding(cfg, xp, dtype)
        self.hidden_size = cfg.hidden_size

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """This stage's KV cache for a micro-batch of ``batch`` rows and ``capacity`` slots."""
        kv_heads = self.decoder[0].attention.kv_heads
        return KVCache(self.ops, len(self.decoder), batch, kv_heads, capacity,
                       self.cfg.head_dim, self.dtype)

    def embed(self, ids):
        """(B, T) token ids -> (B, T, hidden) (first stage)."""
        return self.embedding(ids)

    def forward(self, x, rows: AttentionRows, cache: KVCache):
        """Run this stage's layers on x (B, T, hidden): row b's T tokens sit at positions
        [starts[b], starts[b] + T) of its sequence (``rows``), and go to those cache slots."""
        xp = self.xp
        T = x.shape[1]
        positions = rows.starts().astype(xp.int64)[:, None] + xp.arange(T)[None, :]  # (B, T)
        cos, sin = self.rope.tables(positions)
        pending = None
        for i, layer in enumerate(self.decoder):
            x, pending = layer(x, pending, cos, sin, rows, cache, i)
        return x + pending if pending is not None else x

    def logits(self, x):
        """(B, T, hidden) -> this rank's (B, T, vocab_per_partition) float32 logits (last)."""
        h = self.ops.rms_norm.forward(x, self.final_norm, self.cfg.rms_norm_eps)
        return self.head.local_logits(h)
