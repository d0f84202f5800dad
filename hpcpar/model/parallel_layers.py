"""Megatron's tensor-parallel layers, on plain arrays (NumPy or CuPy, through ``xp``).

Notation: a linear layer computes Y = X A^T + b with Hugging Face's A of shape [out, in].
p is the tp size, i this rank. Megatron's two conjugate operators name the communication:
f is the identity forward and an AllReduce backward; g is an AllReduce forward and the
identity backward. Inference runs the forward halves; the backward halves are stated for the
training step that builds on these layers.

Weights are stored transposed, [in, out] and contiguous, so every product is one GEMM over
the flattened (B*T) rows (on the CPU a transposed operand costs ~20% at decode sizes). The
caller drops the [out, in] original (``LlamaStage`` takes it out of the loaded shard), so each
weight is held once; a tied LM head that shares its rank's embedding table reads it through a
transposed view instead of a second copy.
"""

from __future__ import annotations

from ..comm import Communicator
from ..ops import Ops, embedding_lookup, linear
from ..sharding import vocab_range


class ColumnParallelLinear:
    """Y_i = X A_i^T + b_i, with A = [A_1; ...; A_p] split along its output features.

    Forward: no communication (f: identity); every rank keeps its own column block Y_i.
    Backward: dX = sum_i dY_i A_i, an AllReduce over tp (f's backward).
    Several projections that read the same X (q/k/v, gate/up) are merged into one GEMM and
    split again on the way out (``sizes``), as vLLM's QKVParallelLinear does.
    """

    def __init__(self, xp, weights: list, biases: list | None = None):
        sizes = [w.shape[0] for w in weights]
        self.bounds = [sum(sizes[:k]) for k in range(1, len(sizes))]   # where to split y
        merged = weights[0] if len(weights) == 1 else xp.concatenate(weights, axis=0)
        self.weight_t = xp.ascontiguousarray(merged.T)             # (in, out_i)
        self.bias = None if not biases else xp.concatenate(biases)
        self.xp = xp

    def __call__(self, x):
        y = linear(x, self.weight_t)
        if self.bias is not None:
            y += self.bias
        return self.xp.split(y, self.bounds, axis=-1) if self.bounds else y


class RowParallelLinear:
    """Y = sum_i X_i A_i^T + b, with A = [A_1, ..., A_p] split along its input features and X
    already split the same way (the output of a column-parallel layer).

    Forward: each rank's partial product is AllReduced over tp (g), then the replicated bias
    is added once. Backward: dX_i = dY A_i, no communication (g's backward is the identity).
    """

    def __init__(self, xp, weight, bias, tp: Communicator):
        self.weight_t = xp.ascontiguousarray(weight.T)   # (in_i, out)
        self.bias = bias
        self.tp = tp

    def __call__(self, x):
        y = linear(x, self.weight_t)
        self.tp.all_reduce(y)
        if self.bias is not None:
            y += self.bias
        return y


class VocabParallelEmbedding:
    """E[ids] with the table split by vocabulary rows: rank i holds rows [start_i, stop_i).

    Forward: each rank looks up the ids it owns and writes zeros for the rest; an AllReduce
    over tp sums the one non-zero contribution per token (g). Backward: each rank scatters
    dY into its own rows only, no communication.
    """

    def __init__(self, xp, weight, vocab_size: int, tp: Communicator):
        self.weight = weight                 # (vocab_per_partition, hidden), padding rows zero
        self.start, self.stop = vocab_range(vocab_size, tp.rank, tp.size)
        self.tp = tp
        self.xp = xp

    def __call__(self, ids):
        out, _, _ = embedding_lookup(self.xp, self.weight, ids, self.start, self.stop,
                                     zero_others=self.tp.size > 1)   # (B, T, hidden)
        if self.tp.size > 1:
            self.tp.all_reduce(out)
        return out


class ParallelLMHead:
    """Logits_i = H W_i^T with W split by vocabulary rows (column-parallel over the vocab).

    Forward: each rank computes the logits of its own vocabulary block; nothing is gathered.
    ``argmax`` and ``top_k`` reduce over tp by exchanging a few candidates per row, and only
    ``full_logits`` AllGathers the whole vocabulary. Backward (with the vocab-parallel
    cross-entropy): dH = sum_i dLogits_i W_i, an AllReduce over tp.
    Padding rows (beyond ``vocab_size``) never win: their logits are -inf.
    """

    def __init__(self, ops: Ops, weight, vocab_size: int, tp: Communicator,
                 shared: bool = False):
        xp = ops.xp
        # shared: ``weight`` is also this rank's embedding table (tied): view it, don't copy
        self.weight_t = weight.T if shared else xp.ascontiguousarray(weight.T)  # (hidden, vocab_i)
        self.vocab_size = vocab_size
        self.start, self.stop = vocab_range(vocab_size, tp.rank, tp.size)
        self.tp = tp
        self.xp = xp
        self.top_k_op = ops.top_k

    def local_logits(self, h):
        """(..., vocab_per_partition) float32 logits of this rank's block, padding at -inf."""
        logits = linear(h, self.weight_t).astype(self.xp.float32, copy=False)
        real = self.stop - self.start
        if real < logits.shape[-1]:
            logits[..., real:] = -self.xp.inf
        return logits

    def full_logits(self, local):
        """(..., vocab_size): every rank's block gathered along the vocabulary (AllGather)."""
        return self.tp.all_gather(local, axis=-1)[..., :self.vocab_size]

    def top_k(self, local, k: int):
        """The k largest logits of each row over the whole vocabulary and their token ids,
        exchanging only k candidates per rank. Returns (values, ids), each (rows, k * tp),
        sorted by logit descending, ties by lower id (the order a single rank would give)."""
        xp = self.xp
        vals, idx = self.top_k_op.local(local.reshape(-1, local.shape[-1]), k)
        ids = (idx + self.start).astype(xp.float32)   # exact: vocab sizes are < 2**24
        both = xp.ascontiguousarray(xp.stack([vals, ids]))                  # (2, rows, k)
        gathered = self.tp.all_gather(both, axis=-1)                        # (2, rows, k*p)
        return self.top_k_op.merge(gathered[0], gathered[1].astype(xp.int64))

    def argmax(self, local):
        """The id of the largest logit of each row over the whole vocabulary (ties: lowest id),
        as a distributed argmax: one (value, id) pair per rank and row is exchanged."""
        vals, ids = self.top_k(local, 1)
        return ids[:, 0]
