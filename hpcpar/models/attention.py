"""Grouped-query self-attention over a tensor-parallel group, with a KV cache in generation.

Each tp rank holds nh/p query heads and their KV heads (kv/p of them, or one KV head shared
by p/kv ranks when kv < p), so attention itself needs no communication; only the output
projection's AllReduce does (see ``RowParallelLinear``), and in backward the AllReduce of dX
after the column-parallel q/k/v. The math is the ops layer's: rotary on q and k, then the
``attention`` op over per-row lengths. A KV head replicated on several tp ranks gets a
partial gradient on each, summed over those ranks by the trainer (``Param.kv_replicated``).
With per-head q/k norms (Qwen3) each rank normalizes its own heads with the shared weights,
whose gradients are therefore partial too and summed over tp (``Param.tp_partial``); OLMo 2's
span the whole projection, over the tp group (``norms.SpanNorms``). The scores' scale
(default 1/sqrt(d)), their soft-capping (Gemma 2: cap tanh(s / cap)) and the sliding window
are the layer's, passed to the op on its rows (``AttentionRows``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

from ..parallel.comm import Communicator
from ..parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                               column_parallel, row_parallel)
from ..parallel.ops import AttentionRows, Ops
from ..parallel.ops import cascade_attention as cascade
from ..parallel.ops.attention import at_positions
from .kv_cache import KVCache

QKV = ("q", "k", "v")        # the projections of x that generation merges into one GEMM


def kept_queries(xp, q, rows: AttentionRows, keep):
    """(q (B, 1, heads, d), rows) of the queries at indices ``keep`` (B,) into T: one query
    per row, which sees its sequence's keys up to its own position (a decode step's rows)."""
    if rows.context is not None:
        raise ValueError("kept queries need the whole sequence on this rank (no cp)")
    kv_lengths = (rows.starts() + xp.asarray(keep) + 1).astype(xp.int32)
    return (at_positions(xp, q, keep),
            replace(rows, q_lengths=xp.ones_like(kv_lengths), kv_lengths=kv_lengths,
                    from_start=False))


class Attention:
    """o_proj(softmax(rope(Q) rope(K)^T / sqrt(d) + mask) V) over this rank's heads."""

    def __init__(self, ops: Ops, heads: int, kv_heads: int, head_dim: int,
                 qkv: ColumnParallelLinear, o: RowParallelLinear, qk_norms=None,
                 window: int | None = None, scale: float | None = None,
                 softcap: float | None = None, whole_qk_norms: bool = False):
        self.ops = ops
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim  # per partition
        self.qkv, self.o = qkv, o
        self.qk_norms = qk_norms        # (q's, k's) per-head ``norms.Norm``s, or None
        self.whole_qk_norms = whole_qk_norms   # over the projections: ``norms.SpanNorms``
        self.window = window            # a sliding window over the keys (Mistral), or None
        self.scale, self.softcap = scale, softcap   # the scores' (Gemma 2), or None

    @cached_property
    def cascade_op(self) -> cascade.CascadeAttention:
        """Decode attention over rows that share cached keys (made once, on first use)."""
        return cascade.CascadeAttention(self.ops.xp)

    @classmethod
    def of(cls, ops: Ops, w: dict, head_dim: int, tp: Communicator,
           merge: bool = False, qk_norms=None, window: int | None = None,
           scale: float | None = None, softcap: float | None = None,
           whole_qk_norms: bool = False) -> "Attention":
        """From a layer's weights by role (q, k, v, o and their biases)."""
        heads, kv_heads = (w[r].data.shape[0] // head_dim for r in ("q", "k"))
        return cls(ops, heads, kv_heads, head_dim,
                   column_parallel(ops, w, QKV, tp, merge),
                   row_parallel(ops, w, "o", tp, merge), qk_norms, window, scale, softcap,
                   whole_qk_norms)

    def forward(self, x, cos, sin, rows: AttentionRows, cache: KVCache | None = None,
                layer: int = 0, train: bool = False, keep=None):
        """(B, T, hidden) output, and what ``backward`` needs when ``train``. With a ``cache``
        (generation) this step's keys and values go to its layer ``layer`` and attention
        reads every cached one; without (training) the keys are this step's own. With
        ``keep`` (B,) host indices into T (inference), the output at those queries alone,
        (B, 1, hidden), every position's keys and values still computed and cached."""
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        if self.window is not None or self.scale is not None or self.softcap is not None:
            rows = replace(rows, window=self.window, scale=self.scale, softcap=self.softcap)
        q, k, v = self.qkv(x)
        B, T = q.shape[:2]      # every position, x split along them or not (sequence parallel)
        nctx = None
        if self.qk_norms is not None and self.whole_qk_norms:     # over (B, T, nh hd)
            (q, k), nctx = self.qk_norms.forward(q, k, train)     # ``norms.SpanNorms``
        q = q.reshape(B, T, nh, hd)                                   # (B, T, nh, hd)
        k = k.reshape(B, T, nkv, hd)                                  # (B, T, nkv, hd)
        v = v.reshape(B, T, nkv, hd)
        if self.qk_norms is not None and not self.whole_qk_norms:   # per head
            (q, qctx), (k, kctx) = (n.forward(a, train) for n, a in zip(self.qk_norms, (q, k)))
            nctx = (qctx, kctx)
        q, k = self.ops.rotary.forward(q, k, cos, sin)
        if cache is None:
            keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        else:
            keys, values = cache.write(layer, k, v, rows.cache_slots(), rows.from_start,
                                       rows.max_kv)
        if keep is not None:
            q, rows = kept_queries(self.ops.xp, q, rows, keep)
        groups = getattr(cache, "prefix_groups", None)      # rows that share cached keys
        if train:
            out, actx = self.ops.attention.forward_train(q, keys, values, rows)
        elif groups is not None and keep is None and cascade.applies(rows, T):
            out, actx = self.cascade_op.forward(q, keys, values, rows, groups), None
        else:
            out, actx = self.ops.attention.forward(q, keys, values, rows), None
        out = out.reshape(B, q.shape[1], nh * hd)
        return self.o(out), ((x, cos, sin, actx, out, nctx) if train else None)

    def backward(self, dy, ctx, sink):
        x, cos, sin, actx, out, nctx = ctx
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        dout = self.o.backward(dy, out, sink)                         # g backward: identity
        B, T = dout.shape[:2]                                         # every position
        dq, dk, dv = self.ops.attention.backward(dout.reshape(B, T, nh, hd), actx)
        dq, dk = self.ops.rotary.backward(dq, dk.transpose(0, 2, 1, 3), cos, sin)
        if self.whole_qk_norms:
            dq, dk = self.qk_norms.backward(dq.reshape(B, T, nh * hd),
                                            dk.reshape(B, T, nkv * hd), nctx, sink)
        elif nctx is not None:
            qn, kn = self.qk_norms
            dq, dk = qn.backward(dq, nctx[0], sink), kn.backward(dk, nctx[1], sink)
        return self.qkv.backward([dq.reshape(B, T, nh * hd), dk.reshape(B, T, nkv * hd),
                                  dv.transpose(0, 2, 1, 3).reshape(B, T, nkv * hd)], x, sink)
