"""Megatron's tensor-parallel layers, for any model: generation and training alike.

Notation: a linear layer computes Y = X A^T + b with A of shape [out, in] (Hugging Face's and
torch's orientation). p is the tp size, i this rank. The communication is Megatron's two
conjugate operators (``mappings``): f (identity forward, AllReduce backward) and g (AllReduce
forward, identity backward). Every layer has both halves: ``forward`` / ``__call__`` and
``backward``, which returns the input gradient and hands weight gradients to a ``GradSink``
(added at once, or deferred to a zero-bubble schedule's W pass). X of shape (B, T, ...) is
flattened to N = B*T rows for every product.

Weights are objects with a ``data`` array in [out, in] orientation, read at every call (an
optimizer may move it): a ``Parameter`` (training), or a ``Frozen`` weight (inference), whose
matrices are stored transposed, [in, out] and contiguous, so that the product's operand
``data.T`` is (on the CPU a transposed operand costs ~20% at decode sizes). Inference may
merge the projections that read the same input (q/k/v, gate/up) into one GEMM, as vLLM's
QKVParallelLinear does. ``from_full`` builds a layer from the whole weight, each rank keeping
its slice; the constructors take this rank's shards.

The products, lookups and the cross-entropy's local pieces are ``hpcpar.ops`` (a NumPy
reference, or a device kernel chosen once per backend); ``ops`` defaults to the references.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comm import Communicator
from ..dtypes import at_least_float32
from ..ops import Ops, embedding_lookup, native_ops
from . import splits
from .mappings import CopyToGroup, ReduceFromGroup
from .params import GradSink, Parameter


@dataclass(eq=False)
class Frozen:
    """A weight without a gradient (generation): ``data`` in Hugging Face's orientation."""

    data: object


def frozen_matrix(xp, blocks: list) -> Frozen:
    """[out_k, in] blocks stacked along out, stored transposed ([in, sum out_k], contiguous):
    ``data`` is its [out, in] view. The blocks are copied; the caller drops them."""
    merged = blocks[0] if len(blocks) == 1 else xp.concatenate(blocks, axis=0)
    return Frozen(xp.ascontiguousarray(merged.T).T)


def _rows(a):
    """(..., k) -> (N, k), a view."""
    return a.reshape(-1, a.shape[-1])


def _product(ops: Ops, x, w):
    """X W^T in the weight's dtype."""
    return ops.linear.forward(x, w.data.T).astype(w.data.dtype, copy=False)


def _weight_grads(ops: Ops, dy, x, w, b, sink) -> object:
    """dW = dY^T X, db = sum of dY over rows; returns dX = dY W."""
    dy2 = _rows(dy)
    sink.outer(w, dy2, _rows(x))
    if b is not None:
        sink.add(b, lambda: dy2.sum(axis=0))
    return ops.linear.input_grad(dy, w.data.T).astype(x.dtype, copy=False)


def _keep(tp: Communicator, piece, name: str) -> Parameter:
    """This rank's slice of a whole weight, as a Parameter on the group's backend."""
    backend = tp.backend
    if isinstance(piece, np.ndarray) and backend.on_device:
        data = backend.asarray(np.ascontiguousarray(piece))
    else:
        data = tp.xp.array(piece, copy=True)
    return Parameter(data, name=name, decay=data.ndim > 1)


def _sink(sink, xp):
    return GradSink(xp) if sink is None else sink


def _vocab_rows(tp: Communicator, table, name: str) -> Parameter:
    """This rank's vocabulary rows of ``table``, zero rows after the vocabulary's end."""
    per = splits.padded_vocab_size(table.shape[0], tp.size) // tp.size
    start, stop = splits.vocab_range(table.shape[0], tp.rank, tp.size)
    rows = np.zeros((per,) + tuple(table.shape[1:]), dtype=table.dtype) \
        if isinstance(table, np.ndarray) else tp.xp.zeros((per,) + table.shape[1:], table.dtype)
    rows[:stop - start] = table[start:stop]
    return _keep(tp, rows, name)


class ColumnParallelLinear:
    """Y_i = X A_i^T + b_i, with A = [A_1; ...; A_p] split along its output features.

    Forward: no communication (f: identity); every rank keeps its own column block Y_i.
    Backward: dX = sum_i dY_i A_i, an AllReduce over tp (f's backward).
    Several projections read the same X (q/k/v, gate/up) and come out as a list: one weight
    each (training), or one merged weight whose output is split at ``sizes`` (generation;
    see ``merged``).
    """

    def __init__(self, ops: Ops, weights: list, biases: list | None, tp: Communicator,
                 sizes: list[int] | None = None):
        self.ops, self.weights, self.biases, self.tp = ops, weights, biases, tp
        self.bounds = [sum(sizes[:k]) for k in range(1, len(sizes))] if sizes else None

    @classmethod
    def merged(cls, ops: Ops, weights: list, biases: list | None,
               tp: Communicator) -> "ColumnParallelLinear":
        """One GEMM for ``weights`` (frozen): their arrays are concatenated and dropped."""
        xp = ops.xp
        sizes = [w.data.shape[0] for w in weights]
        weight = frozen_matrix(xp, [w.data for w in weights])
        bias = None
        if biases:
            bias = [Frozen(xp.concatenate([
                b.data if b is not None else xp.zeros(n, dtype=w.data.dtype)
                for b, w, n in zip(biases, weights, sizes)]))]
        return cls(ops, [weight], bias, tp, sizes)

    @classmethod
    def from_full(cls, tp: Communicator, weight, bias=None, sizes=None, ops: Ops | None = None,
                  name: str = "") -> "ColumnParallelLinear":
        """From the whole ``weight`` [out, in] (and ``bias`` [out]), the same on every rank:
        this rank keeps output features [start_i, stop_i) (even, or cut at ``sizes``)."""
        a, b = splits.bounds(weight.shape[0], tp.size, sizes, what="output features")[tp.rank]
        w = _keep(tp, weight[a:b], name)
        bs = [_keep(tp, bias[a:b], name + ".bias")] if bias is not None else None
        return cls(ops or native_ops(tp.xp), [w], bs, tp)

    def forward(self, x):
        """(Y_i, ctx) of a single-weight layer (a list of Y's for several weights)."""
        ys = self(x)
        return (ys[0] if len(ys) == 1 else ys), x

    def __call__(self, x) -> list:
        ys = []
        for k, w in enumerate(self.weights):
            y = _product(self.ops, x, w)
            if self.biases and self.biases[k] is not None:
                y += self.biases[k].data
            ys.append(y)
        return self.ops.xp.split(ys[0], self.bounds, axis=-1) if self.bounds else ys

    def backward(self, dys, x, sink=None):
        """dX, AllReduced over tp, from the outputs' gradients (one weight per output; an
        array for one weight). Weight gradients go to ``sink`` (default: added at once)."""
        dys = dys if isinstance(dys, (list, tuple)) else [dys]
        sink = _sink(sink, self.ops.xp)
        biases = self.biases or [None] * len(self.weights)
        dx = None
        for dy, w, b in zip(dys, self.weights, biases):
            d = _weight_grads(self.ops, dy, x, w, b, sink)
            if dx is None:
                dx = d
            else:
                dx += d
        return CopyToGroup.backward(dx, self.tp)


def column_parallel(ops: Ops, w: dict, roles: tuple, tp: Communicator,
                    merge: bool) -> ColumnParallelLinear:
    """The column-parallel projections ``roles`` of a layer's weights ``w`` (by role; biases
    under role + "_bias", where the model has them), merged when ``merge``."""
    biases = [w.get(r + "_bias") for r in roles]
    biases = biases if any(b is not None for b in biases) else None
    make = ColumnParallelLinear.merged if merge else ColumnParallelLinear
    return make(ops, [w[r] for r in roles], biases, tp)


def row_parallel(ops: Ops, w: dict, role: str, tp: Communicator,
                 merge: bool) -> "RowParallelLinear":
    """The row-parallel projection ``role``, stored transposed when ``merge`` (frozen)."""
    weight = frozen_matrix(ops.xp, [w[role].data]) if merge else w[role]
    return RowParallelLinear(ops, weight, w.get(role + "_bias"), tp)


class RowParallelLinear:
    """Y = sum_i X_i A_i^T + b, with A = [A_1, ..., A_p] split along its input features and X
    already split the same way (the output of a column-parallel layer).

    Forward: each rank's partial product is AllReduced over tp (g), then the replicated bias
    is added once. Backward: dX_i = dY A_i, no communication (g's backward is the identity).
    """

    def __init__(self, ops: Ops, weight, bias, tp: Communicator):
        self.ops, self.weight, self.bias, self.tp = ops, weight, bias, tp

    @classmethod
    def from_full(cls, tp: Communicator, weight, bias=None, sizes=None, ops: Ops | None = None,
                  name: str = "") -> "RowParallelLinear":
        """From the whole ``weight`` [out, in] (and ``bias`` [out], replicated): this rank
        keeps input features [start_i, stop_i) (even, or cut at ``sizes``)."""
        a, b = splits.bounds(weight.shape[1], tp.size, sizes, what="input features")[tp.rank]
        w = _keep(tp, weight[:, a:b], name)
        bias = _keep(tp, bias, name + ".bias") if bias is not None else None
        return cls(ops or native_ops(tp.xp), w, bias, tp)

    def forward(self, x):
        """(Y, ctx)."""
        return self(x), x

    def __call__(self, x):
        y = ReduceFromGroup.forward(_product(self.ops, x, self.weight), self.tp)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy, x, sink=None):
        """dX_i = dY A_i (g's backward: no communication); weight gradients to ``sink``."""
        return _weight_grads(self.ops, dy, x, self.weight, self.bias, _sink(sink, self.ops.xp))


class VocabParallelEmbedding:
    """E[ids] with the table split by vocabulary rows: rank i holds rows [start_i, stop_i).

    Forward: each rank looks up the ids it owns and writes zeros for the rest; an AllReduce
    over tp sums the one non-zero contribution per token (g). Backward: each rank scatters
    dY into its own rows only (repeated ids summed), no communication.
    """

    def __init__(self, xp, weight, vocab_size: int, tp: Communicator):
        self.xp, self.weight, self.tp = xp, weight, tp   # (vocab_per_partition, hidden)
        self.start, self.stop = splits.vocab_range(vocab_size, tp.rank, tp.size)

    @classmethod
    def from_full(cls, tp: Communicator, table, name: str = "") -> "VocabParallelEmbedding":
        """From the whole table [vocab, hidden]: this rank keeps its vocabulary rows, padded
        with zero rows to ceil(vocab / p) (``splits.vocab_range``)."""
        return cls(tp.xp, _vocab_rows(tp, table, name), table.shape[0], tp)

    def forward(self, ids):
        """(B, T, hidden) and the ctx ``backward`` needs."""
        out, local, owned = embedding_lookup(self.xp, self.weight.data, ids, self.start,
                                             self.stop, zero_others=self.tp.size > 1)
        if self.tp.size > 1:
            ReduceFromGroup.forward(out, self.tp)
        return out, (local, owned)

    def backward(self, dy, ctx, sink=None) -> None:
        """Adds dY's rows to the gradient of this rank's table rows (no communication)."""
        local, owned = ctx
        _sink(sink, self.xp).scatter_rows(self.weight, local[owned], dy[owned])


class ParallelLMHead:
    """Logits_i = H W_i^T with W split by vocabulary rows (column-parallel over the vocab).

    Forward: each rank computes the logits of its own vocabulary block; nothing is gathered.
    ``argmax`` and ``top_k`` reduce over tp by exchanging a few candidates per row, and only
    ``full_logits`` AllGathers the whole vocabulary. Backward (from the vocab-parallel
    cross-entropy): dH = sum_i dLogits_i W_i, an AllReduce over tp.
    Padding rows (beyond ``vocab_size``) never win: their logits are -inf. A tied head is
    the embedding's weight (generation: the first stage's own table, read transposed).
    """

    def __init__(self, ops: Ops, weight, vocab_size: int, tp: Communicator):
        self.ops, self.xp, self.weight, self.tp = ops, ops.xp, weight, tp
        self.vocab_size = vocab_size
        self.start, self.stop = splits.vocab_range(vocab_size, tp.rank, tp.size)

    @classmethod
    def from_full(cls, tp: Communicator, weight, ops: Ops | None = None,
                  name: str = "") -> "ParallelLMHead":
        """From the whole head [vocab, hidden]: this rank keeps its vocabulary rows."""
        return cls(ops or native_ops(tp.xp), _vocab_rows(tp, weight, name), weight.shape[0], tp)

    def local_logits(self, h):
        """(..., vocab_per_partition) logits of this rank's block, float32 at least,
        padding at -inf."""
        logits = at_least_float32(self.xp, _product(self.ops, h, self.weight))
        real = self.stop - self.start
        if real < logits.shape[-1]:
            logits[..., real:] = -self.xp.inf
        return logits

    def backward(self, dlogits, h, sink=None):
        """dH, AllReduced over tp, from this block's logit gradients (in h's dtype)."""
        dlogits = dlogits.astype(h.dtype, copy=False).reshape(h.shape[:-1] + (-1,))
        dh = _weight_grads(self.ops, dlogits, h, self.weight, None, _sink(sink, self.xp))
        return CopyToGroup.backward(dh, self.tp)

    def full_logits(self, local):
        """(..., vocab_size): every rank's block gathered along the vocabulary (AllGather)."""
        return self.tp.all_gather(local, axis=-1)[..., :self.vocab_size]

    def top_k(self, local, k: int):
        """The k largest logits of each row over the whole vocabulary and their token ids,
        exchanging only k candidates per rank. Returns (values, ids), each (rows, k * tp),
        sorted by logit descending, ties by lower id (the order a single rank would give)."""
        xp = self.xp
        vals, idx = self.ops.top_k.local(local.reshape(-1, local.shape[-1]), k)
        ids = (idx + self.start).astype(xp.float32)   # exact: vocab sizes are < 2**24
        both = xp.ascontiguousarray(xp.stack([vals, ids]))                  # (2, rows, k)
        gathered = self.tp.all_gather(both, axis=-1)                        # (2, rows, k*p)
        return self.ops.top_k.merge(gathered[0], gathered[1].astype(xp.int64))

    def argmax(self, local):
        """The id of the largest logit of each row over the whole vocabulary (ties: lowest id),
        as a distributed argmax: one (value, id) pair per rank and row is exchanged."""
        vals, ids = self.top_k(local, 1)
        return ids[:, 0]


class VocabParallelCrossEntropy:
    """Mean token cross-entropy of the column-parallel head's logits, never gathering the
    vocabulary (Megatron's vocab-parallel cross-entropy; the math is ``ops.cross_entropy``):
    one AllReduce(max) and one AllReduce(sum) of two numbers per row over tp, forward only."""

    def __init__(self, ops: Ops | None, vocab_size: int, tp: Communicator):
        self.ce, self.tp = (ops or native_ops(tp.xp)).cross_entropy, tp
        self.start, self.stop = splits.vocab_range(vocab_size, tp.rank, tp.size)

    def forward(self, logits, labels, weights):
        """logits (N, V/p) float32, labels (N,) int (-1: ignored), weights (N,) -> (loss, ctx).
        ``logits`` is overwritten (it becomes exp(z - m)), and ``backward`` reuses it."""
        m, sums, ctx = self._reduced(logits, labels)
        loss, _ = self.ce.loss(sums, m, weights)
        return loss, (ctx, sums[0], weights)

    def token_losses(self, logits, labels):
        """-log p(label) of each row (N,) (scoring: log p = minus this); an ignored label's
        value is meaningless. ``logits`` is overwritten."""
        m, sums, _ = self._reduced(logits, labels)
        return self.ce.row_losses(sums, m)

    def _reduced(self, logits, labels):
        """The row max and the sums [sum exp(z - m), z_t] over the whole vocabulary."""
        m = self.ce.local_max(logits, self.stop - self.start)
        self.tp.all_reduce(m, op="max")
        sums, ctx = self.ce.local_sums(logits, m, labels, self.start, self.stop)
        self.tp.all_reduce(sums)
        return m, sums, ctx

    def backward(self, ctx):
        local_ctx, s, weights = ctx
        return self.ce.backward(local_ctx, s, weights)
