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

import numpy as np

from ...models.config import ModelConfig
from ...models.decoder import DecoderStage
from ...models.mlp import MoeMlp
from ...models.tensors import StageSpan
from ...parallel.device import budget
from ...parallel.device.backend import host_array, memory_owner
from ...parallel.comm import Communicator
from ...parallel.context_parallel.ring_attention import ContextShard
from ...parallel.ops import AttentionRows, Ops
from ...parallel.ops.attention import Documents
from ...parallel.expert_parallel.routing import load_balancing_loss
from ...parallel.tensor_parallel.vocab import VocabParallelCrossEntropy
from .memory import activation_bytes
from .params import GradSink, Param
from .sharded_units import NO_HOOKS


@dataclass
class Batch:
    """One micro-batch on the device: T = L - 1 input positions per row.

    ``ids`` (B, T), each row's real tokens first and 0 after them, ``lengths`` (B,) int32
    the real tokens of each row, ``labels`` (B*T,) the next token (-1: ignored), ``weights``
    (B*T,) each label's share of the global loss (1 / labels in the global batch, 0 when
    ignored). Under context parallelism ids, labels and weights are this rank's positions
    of each row (``shard``: which ones), the lengths the whole rows'. ``documents``: packed
    rows' document starts (whole rows, under context parallelism too): attention within
    each document, rotary positions restarting at each."""

    ids: object
    lengths: object
    labels: object
    weights: object
    shard: ContextShard | None = None
    documents: Documents | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)


@dataclass(frozen=True)
class AuxLoss:
    """A mixture of experts' load-balancing loss in training: ``coef`` times the mean over the
    step's ``micro_batches`` (every replica's) of each micro-batch's loss, its MoE layers
    pooled as transformers' ``load_balancing_loss_func`` pools them. ``group``: the ranks
    holding the rest of each micro-batch's tokens (cp); ``counted``: this rank adds the
    value to the reported loss (one rank of the cp group)."""

    coef: float
    micro_batches: int
    group: object = None
    counted: bool = True


class ModelChunk:
    """Training's driver of a ``DecoderStage`` (the layers generation runs), built over this
    chunk's ``Param``s: the forward keeps each layer's ctx (or only its input, with
    recompute), the last chunk adds the loss, and the backward runs the layers in reverse."""

    def __init__(self, cfg: ModelConfig, params: dict[str, Param], span: StageSpan,
                 tp: Communicator, ops: Ops, recompute: bool = False,
                 ep: Communicator | None = None, aux: AuxLoss | None = None,
                 trainable: list[Param] | None = None, sequence_parallel: bool = False):
        """``trainable``: what is trained, when not ``params`` themselves (a LoRA run:
        ``params`` are its frozen base, ``trainable`` its adapters). ``sequence_parallel``:
        the activations between the tp pairs split along the sequence (axis 1) over tp,
        what comes in and goes out (B, T / tp, hidden) (``DecoderStage.split_sequence``)."""
        layers, first, last = span.layers, span.first, span.last
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        self.ops, self.xp, self.tp, self.recompute = ops, ops.xp, tp, recompute
        self.stage = DecoderStage.from_params(cfg, params, span, tp, ops, ep)
        if sequence_parallel:
            self.stage.split_sequence(axis=1)
        if last:
            self.loss = VocabParallelCrossEntropy(ops, cfg.vocab_size, tp)
        self.params = list(params.values()) if trainable is None else list(trainable)
        # a LoRA run's frozen base: weights without gradients (the report counts them)
        self.frozen = [] if trainable is None else [w for w in params.values()
                                                    if not isinstance(w, Param)]
        by_layer: dict[int | None, list] = {}
        for p in params.values():
            by_layer.setdefault(p.spec.layer, []).append(p)
        self.layer_params = [by_layer.get(i, []) for i in layers]   # each layer's weights
        # ZeRO-3 gathers each layer's weights around its use (``sharded_units.ZeroHooks``)
        self.zero = NO_HOOKS
        self.groups = (self._backward_groups(params) if trainable is None
                       else self._adapter_groups(trainable))
        self.aux = aux if aux is not None and aux.coef and first and last else None
        self.aux_sum = 0.0                   # this step's micro-batches' aux losses
        # per MoE layer, the real tokens' top-k choices of each expert this step (on device)
        self.load = {i: self.xp.zeros(cfg.num_experts, np.int64) for i in layers
                     if cfg.is_moe(i)}

    def recompute_saving(self, batch: Batch) -> int:
        """Activation bytes recompute saves on one micro-batch (0 without recompute)."""
        if not self.recompute:
            return 0
        B, T = batch.shape
        args = (self.cfg, self.tp.size, len(self.layers), B, T, self.first, self.last)
        kw = dict(itemsize=self.params[0].data.dtype.itemsize,
                  sequence_parallel=self.stage.sequence_split > 1)
        return (activation_bytes(*args, recompute=False, **kw)
                - activation_bytes(*args, recompute=True, **kw))

    def _backward_groups(self, params: dict[str, Param]) -> list[list[Param]]:
        """The chunk's parameters grouped by when their gradient is complete in a backward
        pass: the head and final norm, then each layer from the last, then the embedding
        (a tied head is the embedding: complete only at the end)."""
        stage = self.stage
        groups = []
        if self.last:
            tied_here = self.first and stage.head.weight is stage.embedding.weight
            groups.append([stage.final_norm] + ([] if tied_here else [stage.head.weight]))
        groups += self.layer_params[::-1]
        if self.first:
            groups.append([stage.embedding.weight])
        return groups

    @property
    def head_params(self) -> list:
        """The last chunk's final norm and head weights (the embedding's, when tied)."""
        return [self.stage.final_norm, self.stage.head.weight]

    def _adapter_groups(self, adapters: list[Param]) -> list[list[Param]]:
        """``_backward_groups`` of a LoRA run: each layer's adapters (nothing for the head
        and the embedding, which are frozen)."""
        by_layer: dict[int, list[Param]] = {}
        for p in adapters:
            by_layer.setdefault(p.spec.layer, []).append(p)
        return (([[]] if self.last else []) + [by_layer.get(i, []) for i in reversed(self.layers)]
                + ([[]] if self.first else []))

    def forward(self, x, batch: Batch):
        """``x``: activations (B, T, hidden), or ignored on the first chunk (it embeds the
        batch's ids). Returns (activations, ctx), or (loss, ctx) on the last chunk: the
        loss is this micro-batch's share of the global mean, a 0-d array."""
        xp, stage = self.xp, self.stage
        B, T = batch.shape
        ctx: dict = {}
        if self.first:
            with self.zero.use([stage.embedding.weight]):
                x, ctx["embed"] = stage.embedding.forward(batch.ids)
            x = stage.scale_embedding(x)
        rows = AttentionRows(batch.lengths, batch.lengths, T, from_start=True,
                             context=batch.shard, documents=batch.documents)
        cos, sin = stage.rope.tables(rows.positions(xp, T))                    # (B, T)
        ctx["rope"] = (cos, sin, rows)
        saved, routings = [], []
        for k, (i, layer) in enumerate(zip(self.layers, stage.decoder)):
            saved.append(x if self.recompute else None)
            if k + 1 < len(self.layers):
                self.zero.prefetch(self.layer_params[k + 1])
            with budget.phase("layer"), self.zero.use(self.layer_params[k]):
                x, m, lctx = layer.forward(x, None, cos, sin, rows, train=True)
                x = x + m
            if not self.recompute:
                saved[-1] = lctx
            if isinstance(layer.mlp, MoeMlp):
                routings.append((i, layer.mlp.moe.routing))
        ctx["layers"] = saved
        aux = 0.0
        if routings:
            real = self._real(rows, batch, T)
            for i, routing in routings:
                self.load[i] += self._real_choices(routing, real)
            if self.aux:
                aux = self._aux_loss([routing for _, routing in routings], real, ctx)
        if not self.last:
            return x, ctx
        with self.zero.use(self.head_params):
            h, ctx["final_norm"] = stage.norm.forward(x, train=True)
            logits = stage.head.local_logits(h).reshape(B * T, -1)            # (N, V/p)
        loss, ctx["loss"] = self.loss.forward(logits, batch.labels, batch.weights)
        ctx["h"] = h
        if aux and self.aux.counted:
            loss = loss + aux
        return loss, ctx

    def _real(self, rows, batch: Batch, T: int):
        """(B*T,) whether each position holds a real token (not padding)."""
        positions = rows.sequence_positions(self.xp, T)
        return (positions < self.xp.asarray(batch.lengths)[:, None]).reshape(-1)

    def _real_choices(self, routing, real):
        """(E,) how many of the real tokens' (``real``, (B*T,) bool) top-k choices went to
        each expert."""
        weights = self.xp.repeat(real.astype(np.int64), routing.experts.shape[1])
        return self.xp.bincount(routing.experts.reshape(-1), weights=weights,
                                minlength=self.cfg.num_experts).astype(np.int64)

    def take_load(self) -> dict[int, np.ndarray]:
        """The step's choices per expert of each MoE layer (host), counting from 0 again."""
        out = {i: host_array(load).copy() for i, load in self.load.items()}
        for load in self.load.values():
            load[...] = 0
        return out

    def _aux_loss(self, routings: list, real, ctx: dict) -> float:
        """This micro-batch's share of the step's load-balancing loss (coef / micro-batches
        times its own, over the ``real`` tokens); the router's gradient per unit of loss goes
        to ``ctx["aux"]``."""
        value, dprobs = load_balancing_loss(self.xp, routings, real, self.aux.group)
        scale = self.aux.coef / self.aux.micro_batches
        ctx["aux"] = dprobs * np.float32(scale)
        if self.aux.counted:
            self.aux_sum += value
        return scale * value

    def backward(self, ctx: dict, dy, sink: GradSink, group_done=None):
        """dy: the gradient of the loss w.r.t. this chunk's output (ignored on the last chunk,
        whose output is the loss). Returns dx for the previous chunk, None on the first.
        ``group_done(k)`` is called as soon as ``self.groups[k]`` has its gradient added."""
        stage = self.stage
        done = iter(range(len(self.groups)))

        def finished_group():
            k = next(done)
            if group_done is not None:
                group_done(k)

        if self.last:
            dz = self.loss.backward(ctx.pop("loss"))                           # (N, V/p)
            if self.layers:
                self.zero.prefetch(self.layer_params[-1])
            with self.zero.use(self.head_params):
                dh = stage.head.backward(dz, ctx.pop("h"), sink)
                dy = stage.norm.backward(dh, ctx.pop("final_norm"), sink)
            finished_group()
        cos, sin, rows = ctx["rope"]
        saved, dprobs = ctx.pop("layers"), ctx.pop("aux", None)
        for k in reversed(range(len(stage.decoder))):
            layer, lctx = stage.decoder[k], saved.pop()
            if k > 0:
                self.zero.prefetch(self.layer_params[k - 1])
            moe = dprobs is not None and isinstance(layer.mlp, MoeMlp)
            with self.zero.use(self.layer_params[k]):
                if self.recompute:
                    _, _, lctx = layer.forward(lctx, None, cos, sin, rows, train=True)
                with budget.phase("layer"):        # a device budget counts each layer
                    dy = layer.backward(dy, lctx, sink, dprobs if moe else None)
            finished_group()
        if self.first:
            stage.embedding.backward(stage.scale_embedding(dy), ctx.pop("embed"), sink)
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
        owner = memory_owner(v)
        if hasattr(owner, "nbytes") and id(owner) not in seen:
            seen.add(id(owner))
            return int(owner.nbytes)
        return 0

    return walk(ctx)
