"""The Llama decoder as one pipeline stage on one tensor-parallel rank, for generation and
training alike.

    x = embed(ids)                                    first stage only
    for each layer of this stage:
        x = x + o_proj(attention(rope(q, k), v))      over rms_norm(x)
        x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),  h = rms_norm(x)
    logits = lm_head(rms_norm(x))                     last stage only

This is Hugging Face's ``LlamaForCausalLM`` exactly, split by ``hpcpar.sharding``: two
AllReduces per layer over tp (o_proj, down_proj), one for the embedding, none for the head.
With tied embeddings the last stage's head is the embedding's weight.

Generation builds a stage from loaded tensors (``LlamaStage.from_tensors``: frozen weights,
projections merged) and runs ``forward`` over a KV cache. Training builds it from its
``Param``s (``LlamaStage.from_params``) and runs the same layers with ``train=True``, each
keeping what its ``backward`` needs (``train.chunk`` drives them and adds the loss).
"""

from __future__ import annotations

from ..comm import Communicator
from ..config import LlamaConfig
from ..ops import AttentionRows, Ops
from ..tensors import TensorSpec
from .attention import Attention
from .kv_cache import KVCache
from ..parallel.layers import (ColumnParallelLinear, Frozen, ParallelLMHead, RowParallelLinear,
                              VocabParallelEmbedding, column_parallel, frozen_matrix,
                              row_parallel)
from .rope import RotaryEmbedding


def norm_backward(ops: Ops, dy, ctx, w, sink):
    """The RMSNorm op's backward: returns dx, adds dw. Replicated over tp: no communication."""
    dx, dw = ops.rms_norm.backward(dy, ctx, w.data)
    sink.add(w, lambda: dw)
    return dx


class Mlp:
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel.
    Communication: one AllReduce forward (in down), one backward (after gate/up)."""

    def __init__(self, ops: Ops, gate_up: ColumnParallelLinear, down: RowParallelLinear):
        self.ops, self.gate_up, self.down = ops, gate_up, down

    @classmethod
    def of(cls, ops: Ops, w: dict, tp: Communicator, merge: bool = False) -> "Mlp":
        """From a layer's weights by role (gate, up, down and their biases)."""
        return cls(ops, column_parallel(ops, w, ("gate", "up"), tp, merge),
                   row_parallel(ops, w, "down", tp, merge))

    def forward(self, x, train: bool = False):
        gate, up = self.gate_up(x)
        act = self.ops.swiglu.forward(gate, up)
        return self.down(act), ((x, gate, up, act) if train else None)

    def backward(self, dy, ctx, sink):
        x, gate, up, act = ctx
        dact = self.down.backward(dy, act, sink)                      # g backward: identity
        dgate, dup = self.ops.swiglu.backward(dact, gate, up)
        return self.gate_up.backward([dgate, dup], x, sink)


class DecoderLayer:
    """h = x + attention(norm1(x));  y = h + mlp(norm2(h)), the residual adds fused into the
    next norm: the layer takes and returns (x, pending), pending being the branch output not
    yet added to the residual stream x (None before the first layer).

    ``w`` maps the layer's roles (``tensors.layer_tensors``) to weights: ``Param``s, used as
    they are, or (``merge``) frozen arrays, whose projections are merged and transposed."""

    def __init__(self, cfg: LlamaConfig, w: dict, tp: Communicator, ops: Ops, merge: bool):
        self.attention = Attention.of(ops, w, cfg.head_dim, tp, merge)
        self.mlp = Mlp.of(ops, w, tp, merge)
        self.input_norm, self.post_norm = w["input_norm"], w["post_attention_norm"]
        self.eps = cfg.rms_norm_eps
        self.ops = ops

    def forward(self, x, pending, cos, sin, rows: AttentionRows, cache: KVCache | None = None,
                layer: int = 0, train: bool = False):
        """(x, pending, ctx): ctx is what ``backward`` needs when ``train``, else None."""
        h, x, n1 = self._norm(pending, x, self.input_norm, train)
        a, actx = self.attention.forward(h, cos, sin, rows, cache, layer, train)
        h, x, n2 = self._norm(a, x, self.post_norm, train)
        m, mctx = self.mlp.forward(h, train)
        return x, m, ((n1, actx, n2, mctx) if train else None)

    def _norm(self, branch, x, w, train: bool):
        """(rms_norm(x + branch), x + branch, ctx); no add when ``branch`` is None."""
        norm = self.ops.rms_norm
        if branch is None:
            if train:
                h, ctx = norm.forward_train(x, w.data, self.eps)
                return h, x, ctx
            return norm.forward(x, w.data, self.eps), x, None
        if train:
            return norm.add_forward_train(branch, x, w.data, self.eps)
        h, x = norm.add_forward(branch, x, w.data, self.eps)
        return h, x, None

    def backward(self, dy, ctx, sink):
        """The gradient of the layer's input residual (x + pending) from that of its output
        (x + pending after it)."""
        n1, actx, n2, mctx = ctx
        ops = self.ops
        dx1 = dy + norm_backward(ops, self.mlp.backward(dy, mctx, sink), n2, self.post_norm,
                                 sink)
        return dx1 + norm_backward(ops, self.attention.backward(dx1, actx, sink), n1,
                                   self.input_norm, sink)


class LlamaStage:
    """The layers ``layers`` of the model on this (pp, tp) rank, plus the embedding on the
    first stage and the final norm and head on the last.

    ``weights`` maps each layer (None: the embedding, final norm and head) to its weights by
    role (``tensors.TensorSpec.role``); ``merge`` as in ``DecoderLayer``. The layers take
    each layer's weights out of ``weights`` as they are built, so that merged copies replace
    the originals one layer at a time.
    """

    def __init__(self, cfg: LlamaConfig, weights: dict, layers: range, first: bool,
                 last: bool, tp: Communicator, ops: Ops, dtype, merge: bool):
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        xp = ops.xp
        self.ops, self.xp, self.dtype, self.tp = ops, xp, dtype, tp
        top = weights.get(None, {})
        self.embedding = (VocabParallelEmbedding(xp, top["embed"], cfg.vocab_size, tp)
                          if first else None)
        self.decoder = [DecoderLayer(cfg, weights.pop(i), tp, ops, merge) for i in layers]
        if last:
            self.final_norm = top["final_norm"]
            head = top["embed"] if cfg.tie_word_embeddings else top["head"]
            if merge and not (first and cfg.tie_word_embeddings):
                # stored transposed; a tied head beside its embedding reads that table
                head = frozen_matrix(xp, [head.data])
            self.head = ParallelLMHead(ops, head, cfg.vocab_size, tp)
        self.rope = RotaryEmbedding(cfg, xp, dtype)
        self.hidden_size = cfg.hidden_size
        self.weight_bytes = 0

    @classmethod
    def from_tensors(cls, cfg: LlamaConfig, specs: list[TensorSpec], tensors: dict,
                     layers: range, first: bool, last: bool, tp: Communicator, ops: Ops,
                     dtype) -> "LlamaStage":
        """For generation, from this rank's loaded slices (``load_shard``'s tensors by Hugging
        Face name, taken out of ``tensors``): frozen, in ``dtype``, projections merged."""
        by_layer: dict = {}
        for spec in specs:
            by_layer.setdefault(spec.layer, {})[spec.role] = Frozen(
                tensors.pop(spec.name).astype(dtype, copy=False))
        weight_bytes = sum(w.data.nbytes for group in by_layer.values() for w in group.values())
        stage = cls(cfg, by_layer, layers, first, last, tp, ops, dtype, merge=True)
        stage.weight_bytes = weight_bytes
        return stage

    @classmethod
    def from_params(cls, cfg: LlamaConfig, params: dict, layers: range, first: bool,
                    last: bool, tp: Communicator, ops: Ops) -> "LlamaStage":
        """For training, over ``Param``s by Hugging Face name (their ``data`` in the compute
        dtype, read at every call)."""
        by_layer: dict = {}
        for p in params.values():
            by_layer.setdefault(p.spec.layer, {})[p.spec.role] = p
        dtype = next(iter(params.values())).data.dtype
        stage = cls(cfg, by_layer, layers, first, last, tp, ops, dtype, merge=False)
        stage.weight_bytes = sum(p.data.nbytes for p in params.values())
        return stage

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """This stage's KV cache for a micro-batch of ``batch`` rows and ``capacity`` slots."""
        kv_heads = self.decoder[0].attention.kv_heads
        return KVCache(self.ops, len(self.decoder), batch, kv_heads, capacity,
                       self.cfg.head_dim, self.dtype)

    def embed(self, ids):
        """(B, T) token ids -> (B, T, hidden) (first stage)."""
        return self.embedding.forward(ids)[0]

    def positions(self, rows: AttentionRows, T: int):
        """The rotary tables (cos, sin) of each row's T positions from its start."""
        xp = self.xp
        positions = rows.starts().astype(xp.int64)[:, None] + xp.arange(T)[None, :]  # (B, T)
        return self.rope.tables(positions)

    def forward(self, x, rows: AttentionRows, cache: KVCache | None):
        """Run this stage's layers on x (B, T, hidden): row b's T tokens sit at positions
        [starts[b], starts[b] + T) of its sequence (``rows``), and go to those cache slots
        (no cache: the T tokens are whole sequences, their keys their own)."""
        cos, sin = self.positions(rows, x.shape[1])
        pending = None
        for i, layer in enumerate(self.decoder):
            x, pending, _ = layer.forward(x, pending, cos, sin, rows, cache, i)
        return x + pending if pending is not None else x

    def final_hidden(self, x):
        """The final norm of x (B, T, hidden): what the head reads (last stage)."""
        return self.ops.rms_norm.forward(x, self.final_norm.data, self.cfg.rms_norm_eps)

    def logits(self, x):
        """(B, T, hidden) -> this rank's (B, T, vocab_per_partition) float32 logits (last)."""
        return self.head.local_logits(self.final_hidden(x))
