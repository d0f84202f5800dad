"""One model chunk for training: a contiguous run of decoder layers on one (pp, tp) rank, with
the embedding when it is the first chunk of the model and the final norm, head and loss when
it is the last.

A pipeline stage holds one chunk, or V non-adjacent ones under the interleaved schedule.

    x = embed(ids)                                 first chunk
    x = layer_i(x) for each layer                  (ctx kept for backward, or only x with
                                                    recompute: the layer is re-run in backward)
    loss = CE(head(final_norm(x)), labels)         last chunk
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import Communicator
from ..config import LlamaConfig
from ..dtypes import at_least_float32
from ..model.rope import RotaryEmbedding
from ..ops import AttentionRows, Ops
from .layers import (DecoderLayer, VocabParallelCrossEntropy, VocabParallelEmbedding, linear,
                     linear_backward, norm_backward)
from .memory import activation_bytes
from .params import GradSink, Param


@dataclass
class Batch:
    """One micro-batch on the device: T = L - 1 input positions per row.

    ``ids`` (B, T), each row's real tokens first and 0 after them, ``lengths`` (B,) int32
    the real tokens of each row, ``labels`` (B*T,) the next token (-1: ignored), ``weights``
    (B*T,) each label's share of the global loss (1 / labels in the global batch, 0 when
    ignored)."""

    ids: object
    lengths: object
    labels: object
    weights: object

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)


class ModelChunk:
    def __init__(self, cfg: LlamaConfig, params: dict[str, Param], layers: range,
                 first: bool, last: bool, tp: Communicator, ops: Ops, recompute: bool = False):
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        xp = ops.xp
        self.ops, self.xp, self.tp, self.recompute = ops, xp, tp, recompute
        by_layer: dict[int | None, dict[str, Param]] = {}
        for p in params.values():
            by_layer.setdefault(p.spec.layer, {})[p.spec.role] = p
        top = by_layer.get(None, {})
        heads = cfg.num_attention_heads // tp.size
        self.decoder = []
        for i in layers:
            kv_heads = by_layer[i]["k"].data.shape[0] // cfg.head_dim
            self.decoder.append(DecoderLayer(ops, by_layer[i], heads, kv_heads, cfg.head_dim,
                                             cfg.rms_norm_eps, tp))
        self.embedding = (VocabParallelEmbedding(xp, top["embed"], cfg.vocab_size, tp)
                          if first else None)
        if last:
            self.final_norm = top["final_norm"]
            self.head = top["embed"] if cfg.tie_word_embeddings else top["head"]
            self.loss = VocabParallelCrossEntropy(ops, cfg.vocab_size, tp)
        self.params = list(params.values())
        self.groups = self._backward_groups(top)
        self.rope = RotaryEmbedding(cfg, xp, self.params[0].data.dtype)

    def recompute_saving(self, batch: Batch) -> int:
        """Activation bytes recompute saves on one micro-batch (0 without recompute)."""
        if not self.recompute:
            return 0
        B, T = batch.shape
        args = (self.cfg, self.tp.size, len(self.decoder), B, T, self.first, self.last)
        itemsize = self.params[0].data.dtype.itemsize
        return (activation_bytes(*args, recompute=False, itemsize=itemsize)
                - activation_bytes(*args, recompute=True, itemsize=itemsize))

    def _backward_groups(self, top: dict[str, Param]) -> list[list[Param]]:
        """The chunk's parameters grouped by when their gradient is complete in a backward
        pass: the head and final norm, then each layer from the last, then the embedding
        (a tied head is the embedding: complete only at the end)."""
        groups = []
        if self.last:
            tied_here = self.first and self.head is top.get("embed")
            head = [self.final_norm] + ([] if tied_here else [self.head])
            groups.append(head)
        groups += [list(layer.p.values()) for layer in reversed(self.decoder)]
        if self.first:
            groups.append([self.embedding.w])
        return groups

    def forward(self, x, batch: Batch):
        """``x``: activations (B, T, hidden), or ignored on the first chunk (it embeds the
        batch's ids). Returns (activations, ctx), or (loss, ctx) on the last chunk: the
        loss is this micro-batch's share of the global mean, a 0-d array."""
        xp = self.xp
        B, T = batch.shape
        ctx: dict = {}
        if self.first:
            x, ctx["embed"] = self.embedding.forward(batch.ids)
        positions = xp.broadcast_to(xp.arange(T)[None, :], (B, T))              # (B, T)
        cos, sin = self.rope.tables(positions)
        rows = AttentionRows(batch.lengths, batch.lengths, T, from_start=True)
        ctx["rope"] = (cos, sin, rows)
        saved = []
        for layer in self.decoder:
            if self.recompute:
                saved.append(x)
                x, _ = layer.forward(x, cos, sin, rows)
            else:
                x, lctx = layer.forward(x, cos, sin, rows)
                saved.append(lctx)
        ctx["layers"] = saved
        if not self.last:
            return x, ctx
        h, ctx["final_norm"] = self.ops.rms_norm.forward_train(x, self.final_norm.data,
                                                               self.cfg.rms_norm_eps)
        logits = linear(h, self.head, None).reshape(B * T, -1)                 # (N, V/p)
        logits = at_least_float32(xp, logits)
        loss, ctx["loss"] = self.loss.forward(logits, batch.labels, batch.weights)
        ctx["h"] = h
        return loss, ctx

    def backward(self, ctx: dict, dy, sink: GradSink, group_done=None):
        """dy: the gradient of the loss w.r.t. this chunk's output (ignored on the last chunk,
        whose output is the loss). Returns dx for the previous chunk, None on the first.
        ``group_done(k)`` is called as soon as ``self.groups[k]`` has its gradient added."""
        done = iter(range(len(self.groups)))

        def finished_group():
            k = next(done)
            if group_done is not None:
                group_done(k)

        if self.last:
            dz = self.loss.backward(ctx.pop("loss"))                           # (N, V/p)
            h = ctx.pop("h")
            dz = dz.astype(h.dtype, copy=False).reshape(h.shape[:-1] + (-1,))
            dh = linear_backward(dz, h, self.head, None, sink)
            self.tp.all_reduce(dh)                                             # f backward
            dy = norm_backward(self.ops, dh, ctx.pop("final_norm"), self.final_norm, sink)
            finished_group()
        cos, sin, rows = ctx["rope"]
        saved = ctx.pop("layers")
        for layer in reversed(self.decoder):
            lctx = saved.pop()
            if self.recompute:
                _, lctx = layer.forward(lctx, cos, sin, rows)
            dy = layer.backward(dy, lctx, sink)
            finished_group()
        if self.first:
            self.embedding.backward(dy, ctx.pop("embed"), sink)
            finished_group()
            return None
        return dy


def held_bytes(ctx) -> int:
    """Bytes of the distinct arrays a ctx keeps alive (the activation memory it holds)."""
    seen: set[int] = set()

    def walk(v) -> int:
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x) for x in v)
        base = getattr(v, "base", None)
        owner = v if base is None else base
        if hasattr(owner, "nbytes") and id(owner) not in seen:
            seen.add(id(owner))
            return int(owner.nbytes)
        return 0

    return walk(ctx)
