"""The tensor-parallel Llama layers for training: each forward keeps what its backward needs
(a ``ctx``), and each backward sits next to it. The math of norms, rotary, SwiGLU and
attention, forward and backward, is the ops layer's (``hpcpar.ops``), shared with generation;
what stays here is the parallel structure: the projections, the gradient sink, f and g.

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

from ..comm import Communicator
from ..ops import AttentionRows, Ops, embedding_lookup, linear as _linear, linear_input_grad
from ..sharding import vocab_range
from .params import GradSink, Param


def _rows(a):
    """(..., k) -> (N, k), a view."""
    return a.reshape(-1, a.shape[-1])


def linear(x, w: Param, b: Param | None):
    """Y = X W^T + b, one GEMM over the flattened rows, in the weights' compute dtype."""
    y = _linear(x, w.data.T).astype(w.data.dtype, copy=False)
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
    return linear_input_grad(dy, w.data.T).astype(x.dtype, copy=False)


def norm_backward(ops: Ops, dy, ctx, w: Param, sink: GradSink):
    """The RMSNorm op's backward: returns dx, adds dw. Replicated over tp: no communication."""
    dx, dw = ops.rms_norm.backward(dy, ctx, w.data)
    sink.add(w, lambda: dw)
    return dx


# ---- attention -------------------------------------------------------------------------------

class Attention:
    """o_proj(attention(rope(q), rope(k), v)) over this rank's heads (the ``attention`` and
    ``rotary`` ops hold the math and its backward).

    q/k/v are column-parallel (f before them: dX AllReduced over tp in backward), o is
    row-parallel (g after it: its partial products AllReduced over tp in forward). A KV head
    replicated on several tp ranks gets a partial gradient on each, summed over those ranks
    by the caller (``Param.kv_replicated``).
    """

    def __init__(self, ops: Ops, params: dict[str, Param], heads: int, kv_heads: int,
                 head_dim: int, tp: Communicator):
        self.ops, self.p, self.tp = ops, params, tp
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim   # per partition

    def forward(self, h, cos, sin, rows: AttentionRows):
        p = self.p
        B, T, _ = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        q = linear(h, p["q"], p.get("q_bias")).reshape(B, T, nh, hd)
        k = linear(h, p["k"], p.get("k_bias")).reshape(B, T, nkv, hd)
        v = linear(h, p["v"], p.get("v_bias")).reshape(B, T, nkv, hd)
        q, k = self.ops.rotary.forward(q, k, cos, sin)
        out, actx = self.ops.attention.forward_train(              # (B, T, nh, hd)
            q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), rows)
        out = out.reshape(B, T, nh * hd)
        y = linear(out, p["o"], None)
        self.tp.all_reduce(y)                                       # g
        if "o_bias" in p:
            y += p["o_bias"].data
        return y, (h, cos, sin, actx, out)

    def backward(self, dy, ctx, sink: GradSink):
        p = self.p
        h, cos, sin, actx, out = ctx
        B, T, _ = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        if "o_bias" in p:
            sink.add(p["o_bias"], lambda: _rows(dy).sum(axis=0))
        dout = linear_backward(dy, out, p["o"], None, sink)         # g backward: identity
        dq, dk, dv = self.ops.attention.backward(dout.reshape(B, T, nh, hd), actx)
        dq, dk = self.ops.rotary.backward(dq, dk.transpose(0, 2, 1, 3), cos, sin)
        dq = dq.reshape(B, T, nh * hd)
        dk = dk.reshape(B, T, nkv * hd)
        dv = dv.transpose(0, 2, 1, 3).reshape(B, T, nkv * hd)
        dh = linear_backward(dq, h, p["q"], p.get("q_bias"), sink)
        dh += linear_backward(dk, h, p["k"], p.get("k_bias"), sink)
        dh += linear_backward(dv, h, p["v"], p.get("v_bias"), sink)
        return self.tp.all_reduce(dh)                               # f backward


# ---- SwiGLU MLP ------------------------------------------------------------------------------

class Mlp:
    """down(swiglu(gate(h), up(h))): gate/up column-parallel (f before them), down
    row-parallel (g after it)."""

    def __init__(self, ops: Ops, params: dict[str, Param], tp: Communicator):
        self.ops, self.p, self.tp = ops, params, tp

    def forward(self, h):
        p = self.p
        gate = linear(h, p["gate"], p.get("gate_bias"))
        up = linear(h, p["up"], p.get("up_bias"))
        act = self.ops.swiglu.forward(gate, up)
        y = linear(act, p["down"], None)
        self.tp.all_reduce(y)                                       # g
        if "down_bias" in p:
            y += p["down_bias"].data
        return y, (h, gate, up, act)

    def backward(self, dy, ctx, sink: GradSink):
        p = self.p
        h, gate, up, act = ctx
        if "down_bias" in p:
            sink.add(p["down_bias"], lambda: _rows(dy).sum(axis=0))
        dact = linear_backward(dy, act, p["down"], None, sink)      # g backward: identity
        dgate, dup = self.ops.swiglu.backward(dact, gate, up)
        dh = linear_backward(dgate, h, p["gate"], p.get("gate_bias"), sink)
        dh += linear_backward(dup, h, p["up"], p.get("up_bias"), sink)
        return self.tp.all_reduce(dh)                               # f backward


class DecoderLayer:
    """x1 = x + attention(norm1(x));  y = x1 + mlp(norm2(x1))."""

    def __init__(self, ops: Ops, params: dict[str, Param], heads: int, kv_heads: int,
                 head_dim: int, eps: float, tp: Communicator):
        self.ops, self.p, self.eps = ops, params, eps
        self.attention = Attention(ops, params, heads, kv_heads, head_dim, tp)
        self.mlp = Mlp(ops, params, tp)

    def forward(self, x, cos, sin, rows: AttentionRows):
        norm = self.ops.rms_norm
        h1, n1 = norm.forward_train(x, self.p["input_norm"].data, self.eps)
        a, actx = self.attention.forward(h1, cos, sin, rows)
        x1 = x + a
        h2, n2 = norm.forward_train(x1, self.p["post_attention_norm"].data, self.eps)
        m, mctx = self.mlp.forward(h2)
        return x1 + m, (n1, actx, n2, mctx)

    def backward(self, dy, ctx, sink: GradSink):
        n1, actx, n2, mctx = ctx
        ops = self.ops
        dx1 = dy + norm_backward(ops, self.mlp.backward(dy, mctx, sink), n2,
                                 self.p["post_attention_norm"], sink)
        return dx1 + norm_backward(ops, self.attention.backward(dx1, actx, sink), n1,
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
        out, local, owned = embedding_lookup(self.xp, self.w.data, ids, self.start, self.stop,
                                             zero_others=self.tp.size > 1)  # (B, T, hidden)
        if self.tp.size > 1:
            self.tp.all_reduce(out)
        return out, (local, owned)

    def backward(self, dy, ctx, sink: GradSink) -> None:
        local, owned = ctx
        sink.scatter_rows(self.w, local[owned], dy[owned])


class VocabParallelCrossEntropy:
    """Mean token cross-entropy of the column-parallel head's logits, never gathering the
    vocabulary (Megatron's vocab-parallel cross-entropy; the math is ``ops.cross_entropy``):
    one AllReduce(max) and one AllReduce(sum) of two numbers per row over tp, forward only."""

    def __init__(self, ops: Ops, vocab_size: int, tp: Communicator):
        self.ce, self.tp = ops.cross_entropy, tp
        self.start, self.stop = vocab_range(vocab_size, tp.rank, tp.size)

    def forward(self, logits, labels, weights):
        """logits (N, V/p) float32, labels (N,) int (-1: ignored), weights (N,) -> (loss, ctx).
        ``logits`` is overwritten (it becomes exp(z - m)), and ``backward`` reuses it."""
        m = self.ce.local_max(logits, self.stop - self.start)
        self.tp.all_reduce(m, op="max")
        sums, ctx = self.ce.local_sums(logits, m, labels, self.start, self.stop)
        self.tp.all_reduce(sums)
        loss, _ = self.ce.loss(sums, m, weights)
        return loss, (ctx, sums[0], weights)

    def backward(self, ctx):
        local_ctx, s, weights = ctx
        return self.ce.backward(local_ctx, s, weights)
