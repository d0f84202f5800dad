"""Megatron's vocabulary-parallel layers: the embedding, the LM head and the cross-entropy
with the vocabulary split over tp, never gathering it where a reduction of a few numbers per
row will do.

p is the tp size, i this rank. The vocabulary is cut into p blocks of ceil(V / p) rows
(``splits.vocab_range``); the last block's rows past V are padding, zero in the tables and
-inf in the logits, so they never win an argmax and weigh nothing in a softmax.
"""

from __future__ import annotations

import numpy as np

from ..tensor import splits
from ..comm import Communicator
from ..device.dtypes import at_least_float32
from ..errors import HpcparError
from .layers import (gathered, keep_slice, named_of, product, sink_or_new, split_axis,
                     weight_grads)
from .mappings import CopyToGroup, ReduceFromGroup, ReduceScatterToGroup
from ..ops import Ops, embedding_lookup, native_ops
from ..params import Parameter

# float32 logits of one block of positions, per rank, in a pass over many positions (scoring,
# prompt log-probabilities; the head's output is [rows, block, vocab/tp]): about 256 MiB,
# 512 positions of 16 rows of a 128k vocabulary at tp 1
LOGITS_BLOCK_BYTES = 256 << 20


def _vocab_rows(tp: Communicator, table, name: str, what: str) -> Parameter:
    """This rank's vocabulary rows of ``table``, zero rows after the vocabulary's end (the
    ranks having agreed on the table's shape: one check over tp)."""
    error = None if table.ndim == 2 and table.shape[0] > 0 else HpcparError(
        f"{what}: a table [vocab, hidden]; got one of shape {tuple(table.shape)}")
    tp.agree(what, [("table's shape", tuple(table.shape)), ("dtype", str(table.dtype))], error)
    per = splits.padded_vocab_size(table.shape[0], tp.size) // tp.size
    start, stop = splits.vocab_range(table.shape[0], tp.rank, tp.size)
    rows = np.zeros((per,) + tuple(table.shape[1:]), dtype=table.dtype) \
        if isinstance(table, np.ndarray) else tp.xp.zeros((per,) + table.shape[1:], table.dtype)
    rows[:stop - start] = table[start:stop]
    return keep_slice(tp, rows, name)


class VocabParallelEmbedding:
    """E[ids] with the table split by vocabulary rows: rank i holds rows [start_i, stop_i).

    Forward: each rank looks up the ids it owns and writes zeros for the rest; an AllReduce
    over tp sums the one non-zero contribution per token (g). Backward: each rank scatters
    dY into its own rows only (repeated ids summed), no communication. ``padding_idx``
    (torch's ``nn.Embedding(padding_idx=...)``, which every Hugging Face decoder builds
    with its ``pad_token_id``): that row is looked up as any other but gets no gradient.
    With ``sequence_axis`` (sequence parallelism: the ids' axis of positions) the sum is a
    ReduceScatter along it, each rank keeping its own positions, and the backward
    AllGathers dY first.
    """

    def __init__(self, xp, weight, vocab_size: int, tp: Communicator,
                 padding_idx: int | None = None, *, sequence_axis: int | None = None):
        self.xp, self.weight, self.tp = xp, weight, tp   # (vocab_per_partition, hidden)
        self.sequence_axis = sequence_axis
        self.vocab_size = vocab_size
        self.start, self.stop = splits.vocab_range(vocab_size, tp.rank, tp.size)
        # this rank's local row of the padding id, if it owns it
        self.padding_row = (padding_idx - self.start if padding_idx is not None
                            and self.start <= padding_idx < self.stop else None)

    @classmethod
    def from_full(cls, tp: Communicator, table, name: str = "",
                  padding_idx: int | None = None, *,
                  sequence_axis: int | None = None) -> "VocabParallelEmbedding":
        """From the whole table [vocab, hidden]: this rank keeps its vocabulary rows, padded
        with zero rows to ceil(vocab / p) (``splits.vocab_range``)."""
        return cls(tp.xp, _vocab_rows(tp, table, name, "VocabParallelEmbedding.from_full"),
                   table.shape[0], tp, padding_idx, sequence_axis=sequence_axis)

    def named_parameters(self, prefix: str = "") -> dict[str, Parameter]:
        """``weight``: this rank's rows of the table."""
        return named_of(prefix, "weight", [self.weight])

    def parameters(self) -> list[Parameter]:
        return list(self.named_parameters().values())

    def forward(self, ids):
        """(B, T, hidden) and the ctx ``backward`` needs. Ids outside the vocabulary are
        an error where they are host arrays (a device array's values would cost a sync)."""
        if ids.dtype.kind not in "iu":
            raise HpcparError(f"VocabParallelEmbedding: ids of {ids.dtype}; token ids are "
                              f"integers (ids.astype(np.int64) if they are whole numbers)")
        if isinstance(ids, np.ndarray) and ids.size and (ids.min() < 0
                                                          or ids.max() >= self.vocab_size):
            raise HpcparError(f"VocabParallelEmbedding: ids from {ids.min()} to {ids.max()}; "
                              f"they must be in [0, {self.vocab_size})")
        out, local, owned = embedding_lookup(self.xp, self.weight.data, ids, self.start,
                                             self.stop, zero_others=self.tp.size > 1)
        axis = split_axis(self.tp, self.sequence_axis)
        if axis is not None:
            out = ReduceScatterToGroup.forward(out, self.tp, axis)
        elif self.tp.size > 1:
            ReduceFromGroup.forward(out, self.tp)
        return out, (local, owned)

    def backward(self, dy, ctx, sink=None) -> None:
        """Adds dY's rows to the gradient of this rank's table rows (no communication; with
        sequence parallelism dY is AllGathered first)."""
        local, owned = ctx
        dy = gathered(dy, self.tp, self.sequence_axis)
        if self.padding_row is not None:
            owned = owned & (local != self.padding_row)
        sink_or_new(sink, self.xp).scatter_rows(self.weight, local[owned], dy[owned])


class ParallelLMHead:
    """Logits_i = H W_i^T with W split by vocabulary rows (column-parallel over the vocab).

    Forward: each rank computes the logits of its own vocabulary block; nothing is gathered.
    ``argmax`` and ``top_k`` reduce over tp by exchanging a few candidates per row, and only
    ``full_logits`` AllGathers the whole vocabulary. Backward (from the vocab-parallel
    cross-entropy): dH = sum_i dLogits_i W_i, an AllReduce over tp.
    Padding rows (beyond ``vocab_size``) never win: their logits are -inf. A tied head is
    the embedding's weight (generation: the first stage's own table, read transposed).
    With ``sequence_axis`` (sequence parallelism) H comes split along that axis: the logits
    are of the AllGathered H (every position), and backward ReduceScatters dH.
    """

    def __init__(self, ops: Ops, weight, vocab_size: int, tp: Communicator, *,
                 sequence_axis: int | None = None):
        self.ops, self.xp, self.weight, self.tp = ops, ops.xp, weight, tp
        self.sequence_axis = sequence_axis
        self.vocab_size = vocab_size
        self.start, self.stop = splits.vocab_range(vocab_size, tp.rank, tp.size)

    @classmethod
    def from_full(cls, tp: Communicator, weight, ops: Ops | None = None,
                  name: str = "", *, sequence_axis: int | None = None) -> "ParallelLMHead":
        """From the whole head [vocab, hidden]: this rank keeps its vocabulary rows."""
        return cls(ops or native_ops(tp.xp),
                   _vocab_rows(tp, weight, name, "ParallelLMHead.from_full"), weight.shape[0], tp,
                   sequence_axis=sequence_axis)

    def named_parameters(self, prefix: str = "") -> dict[str, Parameter]:
        """``weight``: this rank's vocabulary rows of the head (the embedding's own
        Parameter when tied: listed once by ``named_parameters`` of a whole model)."""
        return named_of(prefix, "weight", [self.weight])

    def parameters(self) -> list[Parameter]:
        return list(self.named_parameters().values())

    def local_logits(self, h):
        """(..., vocab_per_partition) logits of this rank's block, float32 at least,
        padding at -inf."""
        h = gathered(h, self.tp, self.sequence_axis)
        logits = at_least_float32(self.xp, product(self.ops, h, self.weight))
        real = self.stop - self.start
        if real < logits.shape[-1]:
            logits[..., real:] = -self.xp.inf
        return logits

    def backward(self, dlogits, h, sink=None):
        """dH, AllReduced over tp, from this block's logit gradients (in h's dtype); with
        sequence parallelism H gathered again and dH ReduceScattered."""
        h = gathered(h, self.tp, self.sequence_axis)
        dlogits = dlogits.astype(h.dtype, copy=False).reshape(h.shape[:-1] + (-1,))
        dh = weight_grads(self.ops, dlogits, h, self.weight, None, sink_or_new(sink, self.xp))
        axis = split_axis(self.tp, self.sequence_axis)
        if axis is not None:
            return ReduceScatterToGroup.forward(dh, self.tp, axis)
        return CopyToGroup.backward(dh, self.tp)

    def full_logits(self, local):
        """(..., vocab_size): every rank's block gathered along the vocabulary (AllGather)."""
        return self.tp.all_gather(local, axis=-1)[..., :self.vocab_size]

    def top_k(self, local, k: int):
        """The k largest logits of each row over the whole vocabulary and their token ids,
        exchanging only k candidates per rank. Returns (values, ids), each (rows, k),
        sorted by logit descending, ties by lower id (the order a single rank would give)."""
        xp = self.xp
        vals, idx = self.ops.top_k.local(local.reshape(-1, local.shape[-1]), k)
        ids = (idx + self.start).astype(xp.float32)   # exact: vocab sizes are < 2**24
        both = xp.ascontiguousarray(xp.stack([vals, ids]))                  # (2, rows, k)
        gathered = self.tp.all_gather(both, axis=-1)                        # (2, rows, k*p)
        values, ids = self.ops.top_k.merge(gathered[0], gathered[1].astype(xp.int64))
        return values[:, :k], ids[:, :k]

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
        self.ce, self.tp, self.vocab_size = (ops or native_ops(tp.xp)).cross_entropy, tp, \
            int(vocab_size)
        tp.agree("VocabParallelCrossEntropy", [("vocab_size", int(vocab_size))])
        self.start, self.stop = splits.vocab_range(vocab_size, tp.rank, tp.size)
        self.width = splits.padded_vocab_size(vocab_size, tp.size) // tp.size

    def forward(self, logits, labels, weights):
        """logits (N, ceil(V/p)) float32, labels (N,) int (-1: ignored: its weight counts as
        0), weights (N,) -> (loss, ctx). ``logits`` is overwritten (it becomes exp(z - m)),
        and ``backward`` reuses it."""
        self._check(logits, labels)
        weights = self.ce.xp.where(labels < 0, 0, weights).astype(weights.dtype, copy=False)
        m, sums, ctx = self._reduced(logits, labels)
        loss, _ = self.ce.loss(sums, m, weights)
        return loss, (ctx, sums[0], weights)

    def _check(self, logits, labels) -> None:
        """This rank's block of logits, one label per row; labels in the vocabulary (read
        where they are host arrays: a device array's values would cost a sync)."""
        if logits.dtype.kind != "f" or labels.dtype.kind not in "iu":
            raise HpcparError(f"VocabParallelCrossEntropy: logits of {logits.dtype} and labels "
                              f"of {labels.dtype}; it takes floating-point logits and integer "
                              f"labels")
        if logits.ndim != 2 or logits.shape[-1] != self.width or labels.shape != logits.shape[:1]:
            raise HpcparError(
                f"VocabParallelCrossEntropy: logits {tuple(logits.shape)} and labels "
                f"{tuple(labels.shape)}; it takes this rank's block of the logits, (rows, "
                f"{self.width}) for a vocabulary of {self.vocab_size} over tp {self.tp.size} "
                f"(ParallelLMHead.local_logits), and one label per row")
        if isinstance(labels, np.ndarray) and labels.size and (
                labels.max() >= self.vocab_size or labels.min() < -1):
            raise HpcparError(f"VocabParallelCrossEntropy: labels from {labels.min()} to "
                              f"{labels.max()}; they must be token ids below the vocabulary's "
                              f"{self.vocab_size}, or -1 (ignored)")

    def token_losses(self, logits, labels):
        """-log p(label) of each row (N,) (scoring: log p = minus this); 0 where the label
        is ignored (-1), as torch's ``cross_entropy(..., ignore_index=-1, reduction="none")``.
        ``logits`` is overwritten."""
        self._check(logits, labels)
        m, sums, _ = self._reduced(logits, labels)
        return self.ce.xp.where(labels < 0, 0, self.ce.row_losses(sums, m))

    def label_logprobs(self, logits, labels):
        """(log p(label) (N,), 0 where the label is ignored (-1); the log of each row's
        normalizer, logsumexp z (N,)): a row's log-softmax at any logit v is v minus the
        second. ``logits`` is overwritten."""
        self._check(logits, labels)
        m, sums, _ = self._reduced(logits, labels)
        normalizer = self.ce.xp.log(sums[0]) + m
        return self.ce.xp.where(labels < 0, 0, sums[1] - normalizer), normalizer

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
