"""Multi-head latent attention (DeepSeek-V2/V3's MLA), over a tensor-parallel group, with the
KV cache holding each token's latent and rope key only.

    q      = q_b(rms_norm(q_a(x)))   or q_proj(x)     (B, T, heads, n + r_q): [q_nope, q_rope]
    c, k_r = kv_a(x) split at L;  c = rms_norm(c)     c (B, T, L) the latent, k_r (B, T, r_q)
    q_rope, k_r turned by rotary                      (one k_r for every head)
    k_h    = [c W_uk[h]^T, k_r],  v_h = c W_uv[h]^T   W_uk[h] (n, L), W_uv[h] (dv, L): kv_b's
    out_h  = softmax(scale q_h . k_h) v_h,  y = o_proj([out_h])

What the cache holds per token is [c, k_r], shared by every head (``KVCache`` with no
value part: the latent is the keys), not each head's keys and values. Attention runs in one
of two orders, both the same sums as transformers':

- expanded (several queries a row: prefill, scoring, training), transformers' own: every
  head's k_h and v_h made from the latents the step reads, the op over heads of n + r_q
  (v zero-padded to that width: the op's heads have one width; DeepSeek's v is narrower);
- absorbed (decode, one query a row): kv_b folded into the query and the output,
  q_h . k_h = [q_nope_h W_uk[h], q_rope_h] . [c, k_r] and softmax(.) v_h = (softmax(.)
  [c, k_r]) restricted to c, times W_uv[h]^T: multi-query attention with one head of
  L + r_q whose values are its keys, reading L + r_q numbers per cached token instead of
  heads x (n + r_q + dv) and expanding nothing (expanding would cost every cached token a
  GEMM at every step).

Both are the one attention op every layout runs (tiles, ring attention under cp, cuDNN
where it takes the head).

DeepSeek's rope turns interleaved pairs (x0, x1), (x2, x3), ... (``rope_interleave``):
the same as rotate-half on the evens followed by the odds, a permutation q and k share, so
the scores are transformers' whatever layout the turned part comes out in.

Under tp each rank holds its heads' rows of q_b (or q_proj) and kv_b and its columns of o;
q_a, kv_a and their norms are replicated, every rank computing the latents whole. In the
backward each rank's heads give part of the latents' gradients: q's part is AllReduced by
q_b's column-parallel backward, the kv latent's (with the rope key's) by one AllReduce here,
so the replicated weights' gradients and dX are whole on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

import numpy as np

from ..parallel.comm import Communicator
from ..parallel.ops import AttentionRows, Ops
from ..parallel.params import Parameter
from ..parallel.tensor_parallel.layers import (column_parallel, frozen_matrix, product,
                                               row_parallel, weight_grads)
from ..parallel.ops import cascade_attention as cascade
from ..parallel.ops.attention import at_positions
from .attention import kept_queries
from .config import ModelConfig


def per_head(xp, x, w):
    """x (B, T, h, a) times w (h, a, c), head by head: (B, T, h, c), one batched GEMM."""
    B, T, h, a = x.shape
    y = xp.matmul(x.transpose(2, 0, 1, 3).reshape(h, B * T, a), w)
    return y.reshape(h, B, T, -1).transpose(1, 2, 0, 3)


def per_head_outer(xp, a, b):
    """sum over (B, T) of a[b, t, h]^T b[b, t, h]: (h, m, c) from a (B, T, h, m) and
    b (B, T, h, c) (a weight's gradient per head), one batched GEMM."""
    B, T, h, m = a.shape
    return xp.matmul(a.transpose(2, 3, 0, 1).reshape(h, m, B * T),
                     b.transpose(2, 0, 1, 3).reshape(h, B * T, -1))


class LatentAttention:
    """o_proj(MLA(x)) over this rank's heads (the module's docstring)."""

    def __init__(self, ops: Ops, cfg: ModelConfig, w: dict, tp: Communicator, merge: bool,
                 q_norm, kv_norm):
        xp = ops.xp
        self.ops, self.tp, self.q_norm, self.kv_norm = ops, tp, q_norm, kv_norm
        self.nope, self.rope, self.dv = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.scale = cfg.attn_scale
        self.kv_heads = 1                           # what the cache holds: one latent head

        def alone(role):
            return frozen_matrix(xp, [w.pop(role)]) if merge else w[role]

        self.q_rank, self.both_a = cfg.q_lora_rank, None
        if cfg.q_lora_rank and merge:     # generation: x's two latents in one GEMM
            self.both_a = frozen_matrix(xp, [w.pop("q_a"), w.pop("kv_a")])
            self.q_a = self.kv_a = None
        elif cfg.q_lora_rank:
            self.q_a, self.kv_a = w["q_a"], w["kv_a"]
        else:
            self.q_a, self.kv_a = None, alone("kv_a")
        self.q = column_parallel(ops, w, ("q_b",) if cfg.q_lora_rank else ("q",), tp, merge)
        self.kv_b = alone("kv_b")                           # (heads (n + dv), L), by head
        self.heads = self.kv_b.data.shape[0] // (self.nope + self.dv)
        self.o = row_parallel(ops, w, "o", tp, merge)
        d, self.perm = self.rope, None
        if cfg.rope_interleave:     # (x0, x1), (x2, x3), ... -> the evens, then the odds
            perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
            self.perm, self.unperm = xp.asarray(perm), xp.asarray(np.argsort(perm))
        self._frozen = None
        if merge:                   # frozen: the two halves of kv_b once, as the products read
            uk, uv = self._kv_b()
            self._frozen = (xp.ascontiguousarray(uk), xp.ascontiguousarray(uv))

    @property
    def head_dim(self) -> int:
        """The width of the one cached head: the latent and the rope key."""
        return self.latent + self.rope

    def _kv_b(self):
        """(W_uk (heads, n, L), W_uv (heads, dv, L)) of this rank's heads."""
        if self._frozen is not None:
            return self._frozen
        kv_b = self.kv_b.data.reshape(self.heads, self.nope + self.dv, self.latent)
        return kv_b[:, :self.nope], kv_b[:, self.nope:]

    def _turn(self, x, cos, sin):
        """The rope part turned, DeepSeek's pairs first laid out as rotate-half's halves."""
        if self.perm is not None:
            x = x[..., self.perm]
        return self.ops.rotary.apply(x, cos, sin)

    def _turn_back(self, dy, cos, sin):
        dx = self.ops.rotary.backward_one(dy, cos, sin)
        return dx if self.perm is None else dx[..., self.unperm]

    def _latents(self, x, train: bool):
        """(q (B, T, heads, n + r_q), kv (B, T, L + r_q) before rotary and the kv norm's
        output, ctx)."""
        qctx = None
        if self.both_a is not None:
            both = product(self.ops, x, self.both_a)
            ql, kv = both[..., :self.q_rank], both[..., self.q_rank:]
        else:
            ql = None if self.q_a is None else product(self.ops, x, self.q_a)
            kv = product(self.ops, x, self.kv_a)
        if ql is not None:
            qn, nctx = self.q_norm.forward(ql, train)
            q, = self.q(qn)
            qctx = (qn, nctx)
        else:
            q, = self.q(x)
        c, cctx = self.kv_norm.forward(kv[..., :self.latent], train)
        B, T = x.shape[:2]
        return q.reshape(B, T, self.heads, self.nope + self.rope), kv, c, (qctx, cctx)

    def forward(self, x, cos, sin, rows: AttentionRows, cache=None, layer: int = 0,
                train: bool = False, keep=None):
        """``Attention.forward``'s interface: (B, T, hidden) output and what ``backward``
        needs when ``train``; a ``cache`` gets each token's [c, k_r] (as its keys, no
        values). Several queries a row (prefill, scoring, training) attend expanded keys
        and values, one (decode) the latents with kv_b absorbed (the module's docstring)."""
        xp = self.ops.xp
        B, T, _ = x.shape
        q, kv, c, nctx = self._latents(x, train)
        q_nope = q[..., :self.nope]
        q_rope = self._turn(q[..., self.nope:], cos, sin)                 # (B, T, heads, r)
        k_rope = self._turn(kv[:, :, None, self.latent:], cos, sin)        # (B, T, 1, r)
        key = xp.concatenate([c[:, :, None], k_rope], axis=-1)             # (B, T, 1, L + r)
        rows = replace(rows, scale=self.scale)
        if cache is None:
            keys = key.transpose(0, 2, 1, 3)
        else:
            keys, _ = cache.write(layer, key, key[..., :0], rows.cache_slots(),
                                  rows.from_start, rows.max_kv)
        if keep is not None:
            q_nope = at_positions(xp, q_nope, keep)
            q_rope, rows = kept_queries(xp, q_rope, rows, keep)
        if T > 1:
            heads_out, actx = self._expanded(q_nope, q_rope, keys, rows, train)
        else:                                   # rows that share cached latents: by groups
            heads_out, actx = self._absorbed(q_nope, q_rope, keys, rows, train,
                                             getattr(cache, "prefix_groups", None))
        y = self.o(heads_out)
        return y, ((x, cos, sin, q_nope, heads_out, actx, nctx) if train else None)

    def _attention(self, query, keys, values, rows, train: bool, groups=None):
        """(out, ctx); a decode step's ``groups`` of rows that share cached latents attend
        them once a group (cascade attention, as ``Attention``'s)."""
        if train:
            return self.ops.attention.forward_train(query, keys, values, rows)
        if groups is not None and cascade.applies(rows, query.shape[1]):
            return self.cascade_op.forward(query, keys, values, rows, groups), None
        return self.ops.attention.forward(query, keys, values, rows), None

    @cached_property
    def cascade_op(self) -> cascade.CascadeAttention:
        return cascade.CascadeAttention(self.ops.xp)

    def _absorbed(self, q_nope, q_rope, keys, rows, train: bool, groups=None):
        """(heads' outputs (B, T, heads dv), ctx): one key head [c, k_r], its values the
        keys, the query [q_nope W_uk, q_rope], the output's latent part times W_uv^T."""
        xp = self.ops.xp
        uk, uv = self._kv_b()
        query = xp.concatenate([per_head(xp, q_nope, uk), q_rope], axis=-1)
        out, actx = self._attention(query, keys, keys, rows, train, groups)
        o_lat = out[..., :self.latent]                                     # (B, T, heads, L)
        heads_out = per_head(xp, o_lat, uv.transpose(0, 2, 1))
        return heads_out.reshape(out.shape[:2] + (-1,)), (self._absorbed_back, o_lat, actx)

    def _absorbed_back(self, d_heads, ctx, q_nope, sink):
        """(dq_nope, d of the turned q_rope, d [c, k_r] (B, S, L + r) of this rank's heads)."""
        xp = self.ops.xp
        o_lat, actx = ctx
        uk, uv = self._kv_b()
        d_olat = per_head(xp, d_heads, uv)
        dout = xp.concatenate([d_olat, xp.zeros(d_olat.shape[:3] + (self.rope,),
                                                dtype=d_olat.dtype)], axis=-1)
        dquery, dk, dv = self.ops.attention.backward(dout, actx)
        dq_lat = dquery[..., :self.latent]
        if isinstance(self.kv_b, Parameter):
            sink.add(self.kv_b, lambda: xp.concatenate([
                per_head_outer(xp, q_nope, dq_lat), per_head_outer(xp, d_heads, o_lat)],
                axis=1).reshape(self.kv_b.data.shape))
        return (per_head(xp, dq_lat, uk.transpose(0, 2, 1)), dquery[..., self.latent:],
                (dk + dv)[:, 0])

    def _expanded(self, q_nope, q_rope, keys, rows, train: bool):
        """(heads' outputs (B, T, heads dv), ctx): transformers' order, every head's keys
        [c W_uk^T, k_r] and values c W_uv^T from the latents the step reads, q, k and v
        zero-padded to one width (the op's heads are one width: DeepSeek's v is narrower)."""
        xp = self.ops.xp
        if rows.context is None:                  # the keys the rows read (a cache: fewer)
            keys = keys[:, :, :rows.max_kv]
        latents = keys[:, 0]                                               # (B, S, L + r)
        B, S, h, n, dv = latents.shape[0], latents.shape[1], self.heads, self.nope, self.dv
        kv = product(self.ops, latents[..., :self.latent], self.kv_b).reshape(B, S, h, n + dv)
        width = max(n + self.rope, dv)
        query = xp.zeros(q_nope.shape[:3] + (width,), dtype=q_nope.dtype)
        query[..., :n], query[..., n:n + self.rope] = q_nope, q_rope
        k = xp.zeros((B, h, S, width), dtype=kv.dtype)
        v = xp.zeros((B, h, S, width), dtype=kv.dtype)
        k[..., :n] = kv[..., :n].transpose(0, 2, 1, 3)
        k[..., n:n + self.rope] = latents[:, None, :, self.latent:]
        v[..., :dv] = kv[..., n:].transpose(0, 2, 1, 3)
        out, actx = self._attention(query, k, v, rows, train)
        heads_out = out[..., :dv].reshape(out.shape[:2] + (-1,))
        return heads_out, (self._expanded_back, latents, actx)

    def _expanded_back(self, d_heads, ctx, q_nope, sink):
        """``_absorbed_back``'s, through the expanded keys and values."""
        xp = self.ops.xp
        latents, actx = ctx
        n, r, dv = self.nope, self.rope, self.dv
        dout = xp.zeros(d_heads.shape[:3] + (max(n + r, dv),), dtype=d_heads.dtype)
        dout[..., :dv] = d_heads
        dquery, dk, dv_ = self.ops.attention.backward(dout, actx)           # (B, h, S, w)
        dkv = xp.concatenate([dk[..., :n], dv_[..., :dv]], axis=-1).transpose(0, 2, 1, 3)
        dkv = dkv.reshape(dkv.shape[:2] + (-1,))                           # (B, S, h (n + dv))
        dc = weight_grads(self.ops, dkv, latents[..., :self.latent], self.kv_b, None, sink)
        dkey = xp.concatenate([dc, dk[..., n:n + r].sum(axis=1)], axis=-1)
        return dquery[..., :n], dquery[..., n:n + r], dkey

    def backward(self, dy, ctx, sink):
        """dX (whole on every tp rank) from dY; the weights' gradients to ``sink``."""
        xp = self.ops.xp
        x, cos, sin, q_nope, heads_out, (back, *actx), (qctx, cctx) = ctx
        B, T, _ = x.shape
        d_heads = self.o.backward(dy, heads_out, sink).reshape(B, T, self.heads, self.dv)
        dq_nope, dq_rope, dkey = back(d_heads, actx, q_nope, sink)
        dq = xp.concatenate([dq_nope, self._turn_back(dq_rope, cos, sin)], axis=-1)
        # every rank's heads add to the latent's and the rope key's gradients
        dkey = self.tp.all_reduce(xp.ascontiguousarray(dkey))
        dkv = xp.concatenate([self.kv_norm.backward(dkey[..., :self.latent], cctx, sink),
                              self._turn_back(dkey[:, :, None, self.latent:], cos, sin)[:, :, 0]],
                             axis=-1)
        dx = weight_grads(self.ops, dkv, x, self.kv_a, None, sink)
        dq = dq.reshape(B, T, -1)
        if qctx is None:
            return dx + self.q.backward([dq], x, sink)
        qn, nctx = qctx
        dqn = self.q.backward([dq], qn, sink)                   # AllReduced over tp
        dql = self.q_norm.backward(dqn, nctx, sink)
        return dx + weight_grads(self.ops, dql, x, self.q_a, None, sink)
