"""The tensor-parallel Llama layers for training: each forward keeps what its backward needs
(a ``ctx``), and each backward, written by hand on ``xp`` arrays, sits next to it.

Notation as in ``hpcpar.model.parallel_layers``: Y = X W^T + b with Hugging Face's W of shape
[out, in]; p is the tp size. Megatron's conjugate operators name the communication:

    f: identity forward, AllReduce of dX backward      (before column-parallel layers)
    g: AllReduce forward, identity backward            (after row-parallel layers)

Weight gradients go through a ``GradSink`` (added at once, or deferred to a zero-bubble
schedule's W pass); input gradients are returned. X of shape (B, T, ...) is flattened to
N = B*T rows for every product.

Precision: products run in the dtype of the weights' compute copy (``Param.data``: float32,
or bfloat16 / float16 over float32 masters), as do activations; RMSNorm statistics, the
softmax and the cross-entropy run in float32 at least, as transformers does.
"""

from __future__ import annotations

import math

from ..comm import Communicator
from ..model.attention import attention_mask
from ..model.rope import RotaryEmbedding
from ..sharding import vocab_range
from .params import GradSink, Param


def _rows(a):
    """(..., k) -> (N, k), a view."""
    return a.reshape(-1, a.shape[-1])


def _wide(a):
    """``a`` in float32 at least (statistics and softmax), no copy when it already is."""
    return a if a.dtype.itemsize >= 4 else a.astype("float32")


def linear(x, w: Param, b: Param | None):
    """Y = X W^T + b, one GEMM over the flattened rows, in the weights' compute dtype."""
    y = (_rows(x) @ w.data.T).astype(w.data.dtype, copy=False)
    y = y.reshape(x.shape[:-1] + (w.data.shape[0],))
    if b is not None:
        y += b.data
    return y


def linear_backward(dy, x, w: Param, b: Param | None, sink: GradSink):
    """dW = dY^T X, db = sum of dY over rows, returns dX = dY W (this rank's partial sum when
    W is a column-parallel shard: the caller's f AllReduces it)."""
    dy2 = _rows(dy)
    sink.outer(w, dy2, _rows(x))
    if b is not None:
        sink.add(b, lambda: dy2.sum(axis=0))
    return (dy2 @ w.data).astype(x.dtype, copy=False).reshape(x.shape)


# ---- RMSNorm -----------------------------------------------------------------------------

def rms_norm(x, w: Param, eps: float, xp):
    """y = w * x̂, x̂ = x r, r = 1 / sqrt(mean(x²) + eps) over the hidden dimension (x̂ and r
    in float32 at least). Replicated over tp: no communication either way."""
    xf = _wide(x)
    r = 1.0 / xp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)
    xhat = xf * r
    return w.data * xhat.astype(x.dtype, copy=False), (xhat, r)


def rms_norm_backward(dy, ctx, w: Param, sink: GradSink):
    """dw = sum over rows of dy x̂;  dx = r (g - x̂ mean(g x̂)), g = dy w."""
    xhat, r = ctx
    dyf = _wide(dy)
    sink.add(w, lambda: _rows(dyf * xhat).sum(axis=0))
    g = dyf * _wide(w.data)
    dx = r * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx.astype(dy.dtype, copy=False)


# ---- rotary embedding ----------------------------------------------------------------------

def rope_backward(dy, cos, sin, xp):
    """rope(x) = x cos + R(x) sin with R([x1, x2]) = [-x2, x1]; R is orthogonal with
    R^T = -R, so dx = dy cos - R(dy sin)."""
    ds = dy * sin
    half = dy.shape[-1] // 2
    return dy * cos - xp.concatenate([-ds[..., half:], ds[..., :half]], axis=-1)


# ---- attention -------------------------------------------------------------------------------

class Attention:
    """softmax(Q K^T / sqrt(d) + mask) V over this rank's heads, then o_proj.

    q/k/v are column-parallel (f before them: dX AllReduced over tp in backward), o is
    row-parallel (g after it: its partial products AllReduced over tp in forward). The g
    query heads of one KV head are stacked as rows of one product, as in inference; the KV
    head's gradient sums their contributions. A KV head replicated on several tp ranks
    gets a partial gradient on each, summed over those ranks by the caller (``Param
    .kv_replicated``).
    """

    def __init__(self, xp, params: dict[str, Param], heads: int, kv_heads: int,
                 head_dim: int, tp: Communicator):
        self.xp, self.p, self.tp = xp, params, tp
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim   # per partition
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, h, cos, sin, mask):
        xp, p = self.xp, self.p
        B, T, _ = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        group = nh // nkv
        q = linear(h, p["q"], p.get("q_bias")).reshape(B, T, nh, hd).transpose(0, 2, 1, 3)
        k = linear(h, p["k"], p.get("k_bias")).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        v = linear(h, p["v"], p.get("v_bias")).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        q = RotaryEmbedding.apply(q, cos, sin, xp)                  # (B, nh, T, hd)
        k = RotaryEmbedding.apply(k, cos, sin, xp)                  # (B, nkv, T, hd)
        qs = (q * self.scale).reshape(B, nkv, group * T, hd)        # (B, nkv, g*T, hd)
        scores = _wide(qs @ k.transpose(0, 1, 3, 2)).reshape(B, nkv, group, T, T)
        scores = xp.where(mask, scores, -xp.inf)                    # (B, nkv, g, T, T)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        probs = probs.astype(h.dtype, copy=False).reshape(B, nkv, group * T, T)
        out = (probs @ v).reshape(B, nkv, group, T, hd)             # (B, nkv, g, T, hd)
        out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, nh * hd)   # (B, T, nh*hd)
        y = linear(out, p["o"], None)
        self.tp.all_reduce(y)                                       # g
        if "o_bias" in p:
            y += p["o_bias"].data
        return y, (h, cos, sin, qs, k, v, probs, out)

    def backward(self, dy, ctx, sink: GradSink):
        xp, p = self.xp, self.p
        h, cos, sin, qs, k, v, probs, out = ctx
        B, T, _ = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        group = nh // nkv
        if "o_bias" in p:
            sink.add(p["o_bias"], lambda: _rows(dy).sum(axis=0))
        dout = linear_backward(dy, out, p["o"], None, sink)         # g backward: identity
        dout = dout.reshape(B, T, nkv, group, hd).transpose(0, 2, 3, 1, 4)
        dout = dout.reshape(B, nkv, group * T, hd)                  # (B, nkv, g*T, hd)
        dv = (probs.transpose(0, 1, 3, 2) @ dout).astype(h.dtype, copy=False)   # (B,nkv,T,hd)
        dprobs = _wide(dout @ v.transpose(0, 1, 3, 2))              # (B, nkv, g*T, T)
        pf = _wide(probs)
        dscores = (pf * (dprobs - (dprobs * pf).sum(axis=-1, keepdims=True))).astype(
            h.dtype, copy=False)
        dq = (dscores @ k).astype(h.dtype, copy=False).reshape(B, nh, T, hd) * self.scale
        dk = (dscores.transpose(0, 1, 3, 2) @ qs).astype(h.dtype, copy=False)  # (B,nkv,T,hd)
        dq = rope_backward(dq, cos, sin, xp).transpose(0, 2, 1, 3).reshape(B, T, nh * hd)
        dk = rope_backward(dk, cos, sin, xp).transpose(0, 2, 1, 3).reshape(B, T, nkv * hd)
        dv = dv.transpose(0, 2, 1, 3).reshape(B, T, nkv * hd)
        dh = linear_backward(dq, h, p["q"], p.get("q_bias"), sink)
        dh += linear_backward(dk, h, p["k"], p.get("k_bias"), sink)
        dh += linear_backward(dv, h, p["v"], p.get("v_bias"), sink)
        return self.tp.all_reduce(dh)                               # f backward


# ---- SwiGLU MLP ------------------------------------------------------------------------------

class Mlp:
    """down(silu(gate(h)) * up(h)): gate/up column-parallel (f before them), down
    row-parallel (g after it). silu(z) = z s, s = sigmoid(z); silu'(z) = s (1 + z (1 - s))."""

    def __init__(self, xp, params: dict[str, Param], tp: Communicator):
        self.xp, self.p, self.tp = xp, params, tp

    def forward(self, h):
        p = self.p
        gate = linear(h, p["gate"], p.get("gate_bias"))
        up = linear(h, p["up"], p.get("up_bias"))
        sig = 1.0 / (1.0 + self.xp.exp(-gate))
        act = gate * sig * up
        y = linear(act, p["down"], None)
        self.tp.all_reduce(y)                                       # g
        if "down_bias" in p:
            y += p["down_bias"].data
        return y, (h, gate, up, sig, act)

    def backward(self, dy, ctx, sink: GradSink):
        p = self.p
        h, gate, up, sig, act = ctx
        if "down_bias" in p:
            sink.add(p["down_bias"], lambda: _rows(dy).sum(axis=0))
        dact = linear_backward(dy, act, p["down"], None, sink)      # g backward: identity
        dup = dact * gate * sig
        dgate = dact * up * sig * (1.0 + gate * (1.0 - sig))
        dh = linear_backward(dgate, h, p["gate"], p.get("gate_bias"), sink)
        dh += linear_backward(dup, h, p["up"], p.get("up_bias"), sink)
        return self.tp.all_reduce(dh)                               # f backward


class DecoderLayer:
    """x1 = x + attention(norm1(x));  y = x1 + mlp(norm2(x1))."""

    def __init__(self, xp, params: dict[str, Param], heads: int, kv_heads: int, head_dim: int,
                 eps: float, tp: Communicator):
        self.xp, self.p, self.eps = xp, params, eps
        self.attention = Attention(xp, params, heads, kv_heads, head_dim, tp)
        self.mlp = Mlp(xp, params, tp)

    def forward(self, x, cos, sin, mask):
        h1, n1 = rms_norm(x, self.p["input_norm"], self.eps, self.xp)
        a, actx = self.attention.forward(h1, cos, sin, mask)
        x1 = x + a
        h2, n2 = rms_norm(x1, self.p["post_attention_norm"], self.eps, self.xp)
        m, mctx = self.mlp.forward(h2)
        return x1 + m, (n1, actx, n2, mctx)

    def backward(self, dy, ctx, sink: GradSink):
        n1, actx, n2, mctx = ctx
        dx1 = dy + rms_norm_backward(self.mlp.backward(dy, mctx, sink), n2,
                                     self.p["post_attention_norm"], sink)
        return dx1 + rms_norm_backward(self.attention.backward(dx1, actx, sink), n1,
                                       self.p["input_norm"], sink)


# ---- vocabulary-parallel embedding, head and cross-entropy ---------------------------------

class VocabParallelEmbedding:
    """E[ids] with rank i holding vocabulary rows [start_i, stop_i).

    Forward: look up the owned ids, zeros elsewhere, AllReduce over tp (g). Backward: scatter
    dY into the owned rows only (repeated ids summed), no communication."""

    def __init__(self, xp, weight: Param, vocab_size: int, tp: Communicator):
        self.xp, self.w, self.tp = xp, weight, tp
        self.start, self.stop = vocab_range(vocab_size, tp.rank, tp.size)

    def forward(self, ids):
        xp = self.xp
        owned = (ids >= self.start) & (ids < self.stop)
        local = xp.where(owned, ids - self.start, 0)
        out = self.w.data[local]                                    # (B, T, hidden)
        if self.tp.size > 1:
            out[~owned] = 0
            self.tp.all_reduce(out)
        return out, (local, owned)

    def backward(self, dy, ctx, sink: GradSink) -> None:
        local, owned = ctx
        sink.scatter_rows(self.w, local[owned], dy[owned])


class VocabParallelCrossEntropy:
    """Mean token cross-entropy of the column-parallel head's logits, never gathering the
    vocabulary (Megatron's vocab-parallel cross-entropy).

    With z_i the (N, V/p) logits of rank i and t the target id of each row:
        m = max_j z_j           AllReduce(max) over tp
        s = sum_j exp(z_j - m)  } one AllReduce(sum) over tp of both
        z_t                     } (only the rank owning t contributes z_t)
        loss_row = log s + m - z_t
    The loss is sum(weight_row * loss_row), weight = 1 / (labels in the global batch) for a
    real label and 0 for an ignored one. Backward is local: dz = weight (softmax(z) - onehot(t))
    on the rank's own vocabulary block.
    """

    def __init__(self, xp, vocab_size: int, tp: Communicator):
        self.xp, self.tp = xp, tp
        self.start, self.stop = vocab_range(vocab_size, tp.rank, tp.size)

    def forward(self, logits, labels, weights):
        """logits (N, V/p) float, labels (N,) int (-1: ignored), weights (N,) -> (loss, ctx).
        ``logits`` is overwritten (it becomes exp(z - m)), and ``backward`` reuses it."""
        xp = self.xp
        N, width = logits.shape
        real = self.stop - self.start
        if real < width:                                             # vocabulary padding
            logits[:, real:] = -xp.inf
        m = logits.max(axis=-1)
        self.tp.all_reduce(m, op="max")
        owned = (labels >= self.start) & (labels < self.stop)
        local = xp.where(owned, labels - self.start, 0)
        target = xp.where(owned, logits[xp.arange(N), local], 0.0)
        e = logits                                   # exp(z - m) in place: (N, V/p) is large
        e -= m[:, None]
        xp.exp(e, out=e)
        sums = xp.stack([e.sum(axis=-1), target])                          # (2, N)
        self.tp.all_reduce(sums)
        per_row = xp.log(sums[0]) + m - sums[1]   # log s + m - z_t
        loss = (per_row * weights).sum()
        return loss, (e, sums[0], local, owned, weights)

    def backward(self, ctx):
        xp = self.xp
        e, s, local, owned, weights = ctx
        dz = e                                       # softmax * weight, in place of e
        dz *= (weights / s)[:, None]
        rows = xp.nonzero(owned)[0]
        dz[rows, local[rows]] -= weights[rows]
        return dz


def training_mask(xp, pad, length: int):
    """Causal and left-padding mask for a whole sequence, (B, 1, 1, T, T)."""
    return attention_mask(xp, pad, 0, length)
