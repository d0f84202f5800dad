"""The decoder's RMSNorms: a weight's (w, or 1 + w for Gemma) over the last dimension, and
OLMo 2's over q's and k's whole projections, whose heads are split over tp."""

from __future__ import annotations

from ..parallel.comm import Communicator
from ..parallel.device.dtypes import at_least_float32
from ..parallel.ops import Ops


class Norm:
    """RMSNorm with the config's scale (w, or 1 + w for Gemma), over the last dimension of
    any shape (a per-head norm reads (B, T, heads, head_dim))."""

    def __init__(self, ops: Ops, weight, eps: float, offset: float = 0.0):
        self.ops, self.weight, self.eps, self.offset = ops, weight, eps, offset

    def scale(self):
        w = self.weight.data
        return w + self.offset if self.offset else w

    def forward(self, x, train: bool = False):
        """(y, ctx): ctx is what ``backward`` needs when ``train``, else None."""
        if train:
            return self.ops.rms_norm.forward_train(x, self.scale(), self.eps)
        return self.ops.rms_norm.forward(x, self.scale(), self.eps), None

    def add_forward(self, branch, x, train: bool = False):
        """(rms_norm(x + branch), x + branch, ctx)."""
        if train:
            return self.ops.rms_norm.add_forward_train(branch, x, self.scale(), self.eps)
        h, x = self.ops.rms_norm.add_forward(branch, x, self.scale(), self.eps)
        return h, x, None

    def backward(self, dy, ctx, sink):
        """dx; adds dw (the offset's derivative is 1). Replicated over tp: no communication."""
        dx, dw = self.ops.rms_norm.backward(dy, ctx, self.scale())
        sink.add(self.weight, lambda: dw)
        return dx


class SpanNorms:
    """RMSNorms of q and of k over their whole projections, whose heads are split over tp
    (OLMo 2's): this rank's slice x_i of each one's features, its slice w_i of the weight,
    n the whole projection's features, each of this rank's heads held by R ranks (R > 1 for
    KV heads fewer than tp).

        r = 1 / sqrt(sum_i |x_i|^2 / (R n) + eps)       the sums of every rank (AllReduce)
        y_i = w_i x_i r

    Backward, x̂ = x r, g_i = dy_i w_i (a replicated head's dy_i: this rank's part of it,
    the parts summing to the whole gradient): dx_i = r (g_i - x̂_i D / (R n)), D = sum_i
    <g_i, x̂_i> over every rank (AllReduce); the replicas' dx_i sum to the whole, as the
    projection's backward sums them; dw_i is this rank's slice (a replicated one summed over
    its replicas by the trainer, ``Param.kv_replicated``). q's and k's sums travel in one
    AllReduce of two numbers per token, forward and backward."""

    def __init__(self, q_norm: Norm, k_norm: Norm, tp: Communicator, sizes: tuple[int, int],
                 replicas: tuple[int, int]):
        self.norms, self.tp = (q_norm, k_norm), tp
        self.divisors = tuple(n * r for n, r in zip(sizes, replicas))     # R n of each

    def forward(self, q, k, train: bool = False):
        """((q's y, k's y), ctx) of q (B, T, q_i) and k (B, T, kv_i)."""
        xp = self.norms[0].ops.xp
        xs = (at_least_float32(xp, q), at_least_float32(xp, k))
        sums = self.tp.all_reduce(xp.stack([xp.einsum("...d,...d->...", x, x) for x in xs],
                                           axis=-1))                    # (B, T, 2)
        ys, rs = [], []
        for i, (norm, x, xf) in enumerate(zip(self.norms, (q, k), xs)):
            r = 1.0 / xp.sqrt(sums[..., i:i + 1] * (1.0 / self.divisors[i]) + norm.eps)
            ys.append((xf * r).astype(x.dtype, copy=False) * norm.scale())
            rs.append(r)
        return tuple(ys), ((q, k, rs) if train else None)

    def backward(self, dq, dk, ctx, sink):
        """(dq, dk) of the norms' inputs; adds their weights' gradients."""
        xp = self.norms[0].ops.xp
        q, k, rs = ctx
        parts = []
        for norm, x, dy, r in zip(self.norms, (q, k), (dq, dk), rs):
            xhat = at_least_float32(xp, x) * r
            dyf = at_least_float32(xp, dy)
            dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
            sink.add(norm.weight, lambda dw=dw: dw)
            parts.append((xhat, dyf * norm.scale()))
        dots = self.tp.all_reduce(xp.stack([(g * xhat).sum(axis=-1) for xhat, g in parts],
                                           axis=-1))                    # (B, T, 2)
        return tuple((r * (g - xhat * (dots[..., i:i + 1] * (1.0 / self.divisors[i]))))
                     .astype(dy.dtype, copy=False)
                     for i, ((xhat, g), r, dy) in enumerate(zip(parts, rs, (dq, dk))))


def norm_backward(ops: Ops, dy, ctx, w, sink):
    """The RMSNorm op's backward for a plain weight ``w``: returns dx, adds dw."""
    return Norm(ops, w, eps=0.0).backward(dy, ctx, sink)      # eps is the forward's only
