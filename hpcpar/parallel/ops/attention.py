"""Causal grouped-query softmax attention over rows described by their lengths.

    out[b, t, h] = sum_s p[b, h, t, s] v[b, h / g, s],   p = softmax_s(c(q k^T / sqrt(d)) + mask)

c is the identity, or with a soft cap (Gemma 2) c(s) = cap tanh(s / cap); the scale 1/sqrt(d)
may be another (``AttentionRows.scale``: Gemma 2's query_pre_attn_scalar^-1/2).

Each row's valid tokens come first (no left padding): row b has ``q_lengths[b]`` queries and
``kv_lengths[b]`` keys, and query t sits at position kv_lengths[b] - q_lengths[b] + t, seeing
the keys at positions [0, that position] (causal, bottom-right aligned), or with a sliding
``window`` W only the last W of them, (position - W, position] (Mistral's). Prefill is
q_lengths = kv_lengths; a decode step is q_lengths = 1 over a cache of kv_lengths keys. This is
the interface fused kernels take (cuDNN's padding mask: per-row sequence lengths), and it lets
rows of one batch sit at different points of their sequences.

Packed rows (training): with ``AttentionRows.documents`` a row holds several documents back
to back, and query t sees only the keys of its own document, [start(t), t], start(t) the
position its document begins at; rotary positions restart at each document (t - start(t)).
So a packed row computes exactly what its documents would alone (a block-diagonal causal
mask: flash-attention's varlen, cuDNN's ragged offsets).

Layouts: q (B, T, heads, d) as the qkv GEMM leaves it (views fine); keys and values
(B, kv_heads, S, d), the KV cache's layout (training passes views of its (B, T, kv, d) k and
v), of which the first ``max_kv`` slots are read; out (B, T, heads, d). g = heads / kv_heads query heads share a KV head.
Queries past a row's length (padding) get a finite output that is never used.

Backward (training): with P the probabilities and dO the output gradient,
    dV = P^T dO,  dP = dO V^T,  dS = P (dP - rowsum(dP P)),  dQ = dS K / sqrt(d),
    dK = dS^T Q / sqrt(d)     (summed over the g query heads of each KV head)
and through a soft cap dS times c'(s) = 1 - (c(s) / cap)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..device.dtypes import at_least_float32
from ..errors import HpcparError


@dataclass(frozen=True)
class Documents:
    """Where each position's document begins, for rows packed with several documents:
    ``starts`` (B, L) int32 on the device and ``host``, the same numbers on the host (the tiles
    choose their blocks from them). L is the whole rows' length (under context parallelism
    too: keys come from anywhere in the row); positions past a row's length (padding) start
    a document of their own, at the length."""

    starts: object
    host: object

    @staticmethod
    def build(xp, starts) -> "Documents":
        """From a host integer array (B, L), non-decreasing along each row, starts[b, t] <= t."""
        import numpy as np
        host = np.ascontiguousarray(starts, dtype=np.int32)
        return Documents(xp.asarray(host), host)

    @staticmethod
    def of_lengths(xp, lengths, width: int) -> "Documents":
        """Rows of documents of ``lengths`` (a list per row) back to back, then padding, in
        rows of ``width`` positions."""
        import numpy as np
        starts = np.empty((len(lengths), width), dtype=np.int32)
        for b, row in enumerate(lengths):
            at = 0
            for n in row:
                starts[b, at:at + n] = at
                at += n
            starts[b, at:] = at
        return Documents.build(xp, starts)

    def earliest(self, position: int) -> int:
        """The first key any row's query at ``position`` may see (host int)."""
        return int(self.host[:, position].min())

    def latest(self, position: int) -> int:
        """The last document start of any row's query at ``position`` (host int)."""
        return int(self.host[:, position].max())


@dataclass(frozen=True)
class AttentionRows:
    """The rows of one micro-batch step: per-row query and key counts on the device, and the
    host facts kernels need to choose a shape."""

    q_lengths: object          # (B,) int32: valid queries of each row (first)
    kv_lengths: object         # (B,) int32: valid keys of each row (first), this step's included
    max_kv: int                # keys to read: max(kv_lengths), host int
    from_start: bool           # every row's queries start at position 0 (q_lengths = kv_lengths)
    window: int | None = None  # a query sees its last ``window`` keys only (sliding window)
    scale: float | None = None   # the scores' scale, s = scale q.k (None: 1/sqrt(d))
    softcap: float | None = None   # scores soft-capped, cap tanh(s / cap), before the softmax
    context: object = None     # a ``ContextShard`` (``parallel.context_parallel``): this rank
                               # holds a part of each sequence (context parallelism)
    documents: Documents | None = None   # packed rows: each query sees its own document only
                                         # (whole rows from position 0)

    def __post_init__(self):
        if self.documents is not None and not self.from_start:
            raise HpcparError("packed rows (documents) are whole rows from position 0, as "
                              "training runs them; a KV cache's steps cannot be packed")

    @staticmethod
    def build(xp, q_lengths, kv_lengths, from_start: bool) -> "AttentionRows":
        """From host integer arrays (B,)."""
        import numpy as np
        kv = np.asarray(kv_lengths)
        return AttentionRows(xp.asarray(np.asarray(q_lengths, dtype=np.int32)),
                             xp.asarray(kv.astype(np.int32)),
                             int(kv.max()) if kv.size else 0, from_start)

    def starts(self):
        """(B,) the position of each row's first query: kv_lengths - q_lengths, computed once
        per rows (every layer's cache write and the rotary positions read it)."""
        starts = self.__dict__.get("_starts")
        if starts is None:
            starts = self.__dict__["_starts"] = self.kv_lengths - self.q_lengths
        return starts

    def cached(self, key, make):
        """``make()``, computed once for these rows and ``key`` (the rotary tables of a layer
        type with its own rope: every such layer reads them)."""
        cache = self.__dict__.setdefault("_cached", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def cache_slots(self):
        """(B,) the KV-cache slot of each row's first query's key: its position, or where a
        context-parallel rank keeps it
        (``context_parallel.ring_attention.ContextShard.cache_slots``)."""
        return self.starts() if self.context is None else self.context.cache_slots(self)

    def sequence_positions(self, xp, T: int):
        """(B, T) the position in its row of each row's T queries."""
        if self.context is not None:
            return self.context.query_positions(xp, self, T)
        return self.starts().astype(xp.int64)[:, None] + xp.arange(T)[None, :]

    def positions(self, xp, T: int):
        """(B, T) rotary's position of each row's T queries: in its row, or in its document
        when the rows are packed (restarting at 0 at each)."""
        at = self.sequence_positions(xp, T)
        if self.documents is None:
            return at
        return at - xp.take_along_axis(self.documents.starts, at, axis=1)



def at_positions(xp, x, at):
    """(B, 1, ...) each row's x at its own index ``at[b]`` (host ints) of x (B, T, ...)."""
    return x[xp.arange(len(at)), xp.asarray(at)][:, None]


def attention_mask(xp, rows: AttentionRows, T: int, S: int, t0: int = 0, s0: int = 0):
    """Which keys each query sees, (B, 1, 1, T, S) boolean, for queries [t0, t0 + T) and
    keys [s0, s0 + S): key s <= the query's position and s < kv_length (and s > position -
    window with a sliding window, s >= its document's start in packed rows). A padding
    query (t >= q_length) sees key 0 alone, so its softmax stays finite."""
    t = xp.arange(t0, t0 + T)[None, :, None]                      # (1, T, 1)
    s = xp.arange(s0, s0 + S)[None, None, :]                      # (1, 1, S)
    position = rows.starts().astype(xp.int64)[:, None, None] + t  # (B, T, 1)
    allowed = (s <= position) & (s < rows.kv_lengths[:, None, None])
    if rows.window is not None:
        allowed &= s > position - rows.window
    if rows.documents is not None:                                # whole rows: t is position
        allowed &= s >= rows.documents.starts[:, t0:t0 + T, None]
    padding = t >= rows.q_lengths[:, None, None]                  # (B, T, 1)
    allowed = xp.where(padding, s == 0, allowed)                  # (B, T, S)
    return allowed[:, None, None]                                 # (B, 1, 1, T, S)


def grouped(q, keys, values, rows: AttentionRows):
    """(qs, keys, values): the queries scaled by 1/sqrt(d) with the g query heads that share
    a KV head stacked as rows, (B, kv, g T, d), so each (row, KV head) is a single GEMM against
    its keys with no broadcast copies; the keys and values cut to the ``max_kv`` read."""
    check_layouts(q, keys, values, rows)
    B, T, nh, hd = q.shape
    keys, values = keys[:, :, :rows.max_kv], values[:, :, :rows.max_kv]
    nkv = keys.shape[1]
    qs = (q * score_scale(rows, hd)).transpose(0, 2, 1, 3).reshape(B, nkv, nh // nkv * T, hd)
    return qs, keys, values


def score_scale(rows: AttentionRows, hd: int) -> float:
    """The scores' scale: the rows' (Gemma 2's), else 1/sqrt(d)."""
    return 1.0 / math.sqrt(hd) if rows.scale is None else rows.scale


def soft_cap(xp, scores, cap: float | None):
    """cap tanh(scores / cap), in place (float scores); the scores themselves without a cap."""
    if cap is not None:
        scores /= cap
        xp.tanh(scores, out=scores)
        scores *= cap
    return scores


def soft_cap_grad(xp, ds, capped, cap: float | None):
    """dS through the cap, in place: ds (1 - (c / cap)^2) for the capped scores c (-inf where
    masked, where ds is 0 already)."""
    if cap is not None:
        t = xp.where(xp.isfinite(capped), capped, 0.0) / cap
        ds *= 1.0 - t * t
    return ds


def check_layouts(q, keys, values, rows: AttentionRows) -> None:
    """q (B, T, heads, d) and keys, values (B, kv_heads, S, d) with heads a multiple of
    kv_heads and S at least the keys the rows read (this rank's positions, under context
    parallelism): anything else would read the wrong numbers without a word."""
    shapes = tuple(getattr(a, "shape", ()) for a in (q, keys, values))
    S_needed = rows.max_kv if rows.context is None else q.shape[1] if q.ndim == 4 else 0
    if not (len(shapes[0]) == len(shapes[1]) == 4 and shapes[1] == shapes[2]
            and shapes[1][0] == shapes[0][0] and shapes[1][3] == shapes[0][3]
            and shapes[1][1] > 0 and shapes[0][2] % shapes[1][1] == 0
            and shapes[1][2] >= S_needed):
        raise HpcparError(
            f"attention: q {shapes[0]}, keys {shapes[1]}, values {shapes[2]} for rows that "
            f"read {S_needed} keys; the layouts are q (B, T, heads, d) and keys, values "
            f"(B, kv_heads, S, d), heads a multiple of kv_heads, S at least the keys read")


class Attention:
    def __init__(self, xp):
        self.xp = xp

    def forward(self, q, keys, values, rows: AttentionRows):
        """(B, T, heads, d) attention output (inference: nothing kept)."""
        return self.forward_train(q, keys, values, rows)[0]

    def forward_train(self, q, keys, values, rows: AttentionRows):
        """(out, ctx) where ctx is what ``backward`` needs."""
        xp = self.xp
        qs, keys, values = grouped(q, keys, values, rows)
        B, T, nh, hd = q.shape
        nkv, S = keys.shape[1], keys.shape[2]
        g = nh // nkv
        scores = qs @ keys.transpose(0, 1, 3, 2)                            # (B, nkv, g*T, S)
        scores = at_least_float32(xp, scores).reshape(B, nkv, g, T, S)
        if rows.softcap is not None:
            scores = soft_cap(xp, scores.copy(), rows.softcap)
        capped = scores.reshape(B, nkv, g * T, S) if rows.softcap is not None else None
        scores = xp.where(attention_mask(xp, rows, T, S), scores, -xp.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        probs = probs.astype(q.dtype, copy=False).reshape(B, nkv, g * T, S)
        out = (probs @ values).reshape(B, nkv, g, T, hd)                    # (B, nkv, g, T, d)
        out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)            # (B, T, heads, d)
        return out, (qs, keys, values, probs, capped, rows)

    def backward(self, dout, ctx):
        """(dq (B, T, heads, d), dk, dv (B, kv_heads, S, d)) from dout (B, T, heads, d)."""
        xp = self.xp
        qs, keys, values, probs, capped, rows = ctx
        B, T, nh, hd = dout.shape
        nkv = keys.shape[1]
        g = nh // nkv
        dtype = keys.dtype
        dout = dout.reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4)
        dout = dout.reshape(B, nkv, g * T, hd)                              # (B, nkv, g*T, d)
        dv = (probs.transpose(0, 1, 3, 2) @ dout).astype(dtype, copy=False)
        dprobs = at_least_float32(xp, dout @ values.transpose(0, 1, 3, 2))             # (B, nkv, g*T, S)
        pf = at_least_float32(xp, probs)
        dscores = pf * (dprobs - (dprobs * pf).sum(axis=-1, keepdims=True))
        dscores = soft_cap_grad(xp, dscores, capped, rows.softcap).astype(dtype, copy=False)
        scale = score_scale(rows, hd)
        dq = (dscores @ keys).astype(dtype, copy=False) * scale             # (B, nkv, g*T, d)
        dq = dq.reshape(B, nh, T, hd).transpose(0, 2, 1, 3)                 # (B, T, heads, d)
        dk = (dscores.transpose(0, 1, 3, 2) @ qs).astype(dtype, copy=False)  # (B, nkv, S, d)
        return dq, dk, dv
