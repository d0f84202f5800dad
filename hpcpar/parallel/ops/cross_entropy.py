"""The local pieces of the vocabulary-parallel cross-entropy (Megatron's): rank i holds the
float32 logits z (N, V/p) of its vocabulary block [start, stop), t is each row's target id.

    m   = max_j z_j                  local row max, then AllReduce(max) over tp (the caller's)
    s   = sum_j exp(z_j - m)         } local, then one AllReduce(sum) of both
    z_t                              } (0 on the ranks that do not own t)
    loss_row = log s + m - z_t,      loss = sum(weight_row * loss_row)

weight_row is 1 / (labels in the global batch) for a real label and 0 for an ignored one.
Backward is local, no communication: dz = weight (exp(z - m) / s - onehot(t)).
Columns past the real vocabulary (padding of the last block) hold -inf and never count.
"""

from __future__ import annotations


class CrossEntropy:
    def __init__(self, xp):
        self.xp = xp

    def local_max(self, logits, real: int):
        """The row max (N,) of this block's logits; padding columns [real:) set to -inf."""
        if real < logits.shape[-1]:
            logits[:, real:] = -self.xp.inf
        return logits.max(axis=-1)

    def local_sums(self, logits, m, labels, start: int, stop: int):
        """(sums, ctx): sums (2, N) = this block's [sum exp(z - m), z_t] for the AllReduce;
        ``logits`` becomes exp(z - m) in place ((N, V/p) is large) and ctx keeps it for the
        backward."""
        xp = self.xp
        N = logits.shape[0]
        owned = (labels >= start) & (labels < stop)
        local = xp.where(owned, labels - start, 0)
        target = xp.where(owned, logits[xp.arange(N), local], 0.0)
        e = logits
        e -= m[:, None]
        xp.exp(e, out=e)
        return xp.stack([e.sum(axis=-1), target]), (e, local, owned)

    def row_losses(self, sums, m):
        """-log p(t) of each row (N,), log s + m - z_t, from the reduced sums and max."""
        return self.xp.log(sums[0]) + m - sums[1]

    def loss(self, sums, m, weights):
        """(loss 0-d, per-row losses) from the reduced sums and max."""
        per_row = self.row_losses(sums, m)
        return (per_row * weights).sum(), per_row

    def backward(self, ctx, s, weights):
        """dz (N, V/p), written over exp(z - m)."""
        xp = self.xp
        e, local, owned = ctx
        dz = e
        dz *= (weights / s)[:, None]
        rows = xp.nonzero(owned)[0]
        dz[rows, local[rows]] -= weights[rows]
        return dz
