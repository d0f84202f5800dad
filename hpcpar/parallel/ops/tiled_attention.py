"""Causal grouped-query attention in tiles, flash-attention's way: the same interface and
rows as ``ops.attention`` (per-row lengths, a KV cache, sliding windows), without the whole
(rows, heads, T, S) score matrix.

Queries and keys go in blocks. For each query block an online softmax keeps, per query, the
running maximum m and sum l of exp(score - m) in float32 (float64 in float64 work),
rescaling the output accumulated so far when m grows; key blocks that no row's query of
the block can see (above the causal diagonal, past every row's keys, before every row's
window, or before the documents of packed rows begin) are skipped, and only blocks that some
mask cuts are masked. The backward keeps no
probabilities: it recomputes each block's from the saved log-sum-exp, lse = m + log l,

    P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  dS = P (dP - D),  D = rowsum(dO * O),
    dQ += dS K / sqrt(d),  dK += dS^T Q / sqrt(d)

With a soft cap (Gemma 2) each block's scores go through cap tanh(S / cap) before the
softmax, and dS through its derivative, 1 - (capped / cap)^2 (``_scores`` is the one place
scores are made, forward and backward); the shift known up front does not apply then.

A whole sequence in float32 or float64 (prefill, scoring, training's forward) needs no
running maximum: each query's shift is known before its keys are read (``KnownShift``), so
a span of keys costs two GEMMs and an exp2, the shift and the sum folded into the GEMMs.

Memory: the output, lse and one span of scores, O(B heads T d + block^2) per block row,
against the reference's O(B heads T S). The reference (``ops.attention.Attention``) stays
the test oracle.

``attend`` and ``attend_backward`` take a segment of queries and a segment of keys anywhere
in the sequence (their first positions ``q_at`` and ``k_at``) and give a partial output with
its lse; ``merge`` combines partial outputs over disjoint key sets. The whole-sequence op is
one segment of each; ring attention (``parallel.context_parallel.ring_attention``) is many.
"""

from __future__ import annotations

from ..device.backend import host_array
from ..device.dtypes import accumulator, at_least_float32
from .attention import (Attention, AttentionRows, attention_mask, grouped, score_scale,
                        soft_cap, soft_cap_grad)
from .softmax_shift import LN2, KnownShift, spans

BLOCK = 128                    # queries and keys per tile


def merge(xp, out, lse, part, part_lse) -> None:
    """out, lse <- the softmax attention over the union of two disjoint key sets, from each
    set's normalized output and log-sum-exp (in place; -inf lse: a query saw no key):

        lse' = log(e^lse + e^part_lse),  out' = out e^(lse - lse') + part e^(part_lse - lse')
    """
    new = xp.logaddexp(lse, part_lse)
    safe = xp.where(xp.isfinite(new), new, 0.0)
    out *= xp.exp(lse - safe)[..., None]
    out += part * xp.exp(part_lse - safe)[..., None]
    lse[...] = new


def grouped_heads(q, keys, values, rows: AttentionRows):
    """``ops.attention.grouped`` with the queries as (B, kv, g, T, d): the g query heads of
    each KV head apart from their positions, as the tiles slice them."""
    B, T, nh, hd = q.shape
    qs, keys, values = grouped(q, keys, values, rows)
    nkv = keys.shape[1]
    return qs.reshape(B, nkv, nh // nkv, T, hd), keys, values


class TiledAttention(Attention):
    def __init__(self, xp, block: int = BLOCK):
        super().__init__(xp)
        self.block = block

    # ---- the tiles a query block reads -----------------------------------------------------

    def _tiles(self, rows: AttentionRows, T: int, S: int, q_at: int = 0,
               k_at: int = 0) -> list[tuple[int, int, list]]:
        """(t0, t1, key blocks) for each query block [t0, t1) of T queries from ``q_at``: the
        key blocks (s0, s1, masked) of S keys from ``k_at`` that some query of the block of
        some row sees, ``masked`` when a mask cuts into the block for some query (indices
        local to the segments). The rows are read on the host once per call, and not at all
        for one whole-sequence block (decode steps, short sequences)."""
        if T <= self.block and S <= self.block and q_at == k_at == 0:
            return [(0, T, [(0, S, True)])]
        starts = host_array(rows.starts())
        lo, hi = int(starts.min()), int(starts.max())
        q_len = host_array(rows.q_lengths)
        kv_len = host_array(rows.kv_lengths)
        kv_min, kv_max = int(kv_len.min()), int(kv_len.max())
        docs = rows.documents                             # packed rows (from position 0)
        tiles = []
        for t0 in range(0, T, self.block):
            t1 = min(t0 + self.block, T)
            first, last = lo + q_at + t0, hi + q_at + t1 - 1  # the block's earliest, latest
            padded = bool((q_len < q_at + t1).any())      # padding queries see key 0
            top = min(S, last + 1 - k_at, kv_max - k_at)
            bottom = 0                                    # keys before every window: unseen
            if rows.window is not None and not padded:
                bottom = max(0, first - rows.window + 1 - k_at)
            if docs is not None and not padded:           # and before every document
                bottom = max(bottom, docs.earliest(first) - k_at)
            blocks = []
            for s0 in range(bottom - bottom % self.block, top, self.block):
                s1 = min(s0 + self.block, S)
                # whole block visible to every query of every row of the block?
                inside = (k_at + s1 - 1 <= first and k_at + s1 <= kv_min and not padded
                          and (rows.window is None or k_at + s0 > last - rows.window)
                          and (docs is None or k_at + s0 >= docs.latest(last)))
                blocks.append((s0, s1, not inside))
            tiles.append((t0, t1, blocks))
        return tiles

    def _block_mask(self, rows: AttentionRows, t0: int, t1: int, s0: int, s1: int):
        """(B, 1, 1, tq, sk) which keys [s0, s1) the queries [t0, t1) see (positions)."""
        return attention_mask(self.xp, rows, t1 - t0, s1 - s0, t0, s0)

    # ---- forward ---------------------------------------------------------------------------

    def forward_train(self, q, keys, values, rows: AttentionRows):
        """(out (B, T, heads, d), ctx): ctx keeps q, k, v, the output and lse, not P."""
        B, T, nh, hd = q.shape
        qs, keys, values = grouped_heads(q, keys, values, rows)
        out, lse = self.attend(qs, keys, values, rows, out_dtype=q.dtype)
        result = out.transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)
        return result, (qs, keys, values, out, lse, rows)

    def attend(self, qs, keys, values, rows: AttentionRows, q_at: int = 0, k_at: int = 0,
               out_dtype=None, partial: bool = False):
        """(out (B, kv, g, T, d) in ``out_dtype`` (default: the accumulator's), lse (B, kv,
        g, T)) of the grouped, scaled queries ``qs`` at positions starts + q_at + t against
        the keys and values (B, kv, S, d) at positions k_at + s. A query that sees none of
        these keys gets out 0 and lse -inf: possible away from the sequence's start, or
        where the keys are a ``partial`` set of the sequence's (a KV cache split over ranks)."""
        xp, (B, nkv, g, T, hd) = self.xp, qs.shape
        S = keys.shape[2]
        acc_dtype = accumulator(xp, qs.dtype)
        out_dtype = acc_dtype if out_dtype is None else out_dtype
        empty_rows = partial or bool(q_at or k_at)     # may some query see no key at all?
        out = xp.zeros((B, nkv, g, T, hd), dtype=out_dtype)
        lse = xp.full((B, nkv, g, T), -xp.inf, dtype=acc_dtype)
        if S == 0:
            return out, lse
        shifted = KnownShift.build(xp, qs, keys, values, rows, self.block, q_at, k_at,
                                   partial)
        for t0, t1, blocks in self._tiles(rows, T, S, q_at, k_at):
            tq = t1 - t0
            qb = qs[:, :, :, t0:t1].reshape(B, nkv, g * tq, hd)
            at = (q_at + t0, q_at + t1)
            if not blocks:
                continue
            if len(blocks) == 1:          # one block: its softmax needs no running statistics
                o, lse[:, :, :, t0:t1] = self._one_block(qb, keys, values, rows, at, k_at,
                                                         blocks[0], empty_rows)
            elif shifted is not None:
                o, lse[:, :, :, t0:t1] = self._shifted_tile(shifted, rows, (t0, t1), blocks)
            else:
                o, lse[:, :, :, t0:t1] = self._online_tile(qb, keys, values, rows, at, k_at,
                                                           blocks, empty_rows)
            out[:, :, :, t0:t1] = o.astype(out_dtype, copy=False)
        return out, lse

    def _online_tile(self, qb, keys, values, rows, queries, k_at, blocks, empty_rows: bool):
        """(out, lse) of one query block over its key blocks: the online softmax, its running
        maximum m and sum l rescaling the output accumulated so far when m grows."""
        xp = self.xp
        B, nkv, _, hd = qb.shape
        tq = queries[1] - queries[0]
        g = qb.shape[2] // tq
        acc_dtype = accumulator(xp, qb.dtype)
        m = xp.full((B, nkv, g, tq), -xp.inf, dtype=acc_dtype)
        l = xp.zeros((B, nkv, g, tq), dtype=acc_dtype)
        acc = xp.zeros((B, nkv, g, tq, hd), dtype=acc_dtype)
        for s0, s1, masked in blocks:
            scores = self._scores(qb, keys, rows, queries, k_at, (s0, s1), masked)
            m_new = xp.maximum(m, scores.max(axis=-1))
            safe = xp.where(xp.isfinite(m_new), m_new, 0.0)          # rows seeing nothing
            scores -= safe[..., None]               # in place: the block's one big pass
            p = xp.exp(scores, out=scores)
            rescale = xp.exp(xp.where(xp.isfinite(m), m, safe) - safe)
            l = l * rescale + p.sum(axis=-1)
            pv = (p.astype(qb.dtype, copy=False).reshape(B, nkv, g * tq, s1 - s0)
                  @ values[:, :, s0:s1])
            acc = acc * rescale[..., None] + at_least_float32(xp, pv).reshape(
                B, nkv, g, tq, hd)
            m = m_new
        if empty_rows:
            seen = l > 0
            l = xp.where(seen, l, 1.0)
            m = xp.where(seen, m, -xp.inf)
        return acc / l[..., None], m + xp.log(l)

    def _shifted_tile(self, shifted: "KnownShift", rows, queries, blocks):
        """(out, lse) of one query block over its key blocks with the shift known up front
        (``KnownShift``): per span of keys two GEMMs, [q, -c] [k, 1]^T = S - c (base 2) and
        p [v, 1] = (sum p v, sum p), and one exp2; a span whose scores the bound cannot keep
        in range also takes its maximum and moves c up to it."""
        xp = self.xp
        t0, t1 = queries
        qx = shifted.queries(t0, t1)                          # (B, kv, g tq, d + 1)
        B, nkv, rows_q, width = qx.shape
        acc = xp.zeros((B, nkv, rows_q, width), dtype=qx.dtype)
        joined = spans(blocks, 2 * self.block)
        for (s0, s1, masked), check in zip(joined, shifted.may_overflow(t0, t1, joined)):
            p = qx @ shifted.keys[:, :, :, s0:s1]               # (S - c) log2 e
            if masked:
                view = p.reshape(B, nkv, -1, t1 - t0, s1 - s0)
                xp.copyto(view, -xp.inf, where=~self._block_mask(rows, t0, t1, s0, s1))
            if check:                     # c up to the span's maximum where that is above c
                grow = xp.maximum(p.max(axis=-1), 0.0)
                p -= grow[..., None]
                acc *= xp.exp2(-grow)[..., None]
                qx[..., -1] -= grow
            xp.exp2(p, out=p)
            acc += p @ shifted.values[:, :, s0:s1]
        acc = acc.reshape(B, nkv, -1, t1 - t0, width)
        total = acc[..., -1]
        shift = -qx[..., -1].reshape(total.shape)                # c log2 e, the final c
        return acc[..., :-1] / total[..., None], (shift + xp.log2(total)) * LN2

    def _scores(self, qb, keys, rows: AttentionRows, queries, k_at: int, block,
                masked: bool):
        """(B, kv, g, tq, sk) scores of the queries at positions ``queries`` against the key
        block ``block`` (local, keys from ``k_at``), at least float32, -inf where masked."""
        xp = self.xp
        (t0, t1), (s0, s1) = queries, block
        B, nkv = qb.shape[:2]
        scores = at_least_float32(xp, qb @ keys[:, :, s0:s1].transpose(0, 1, 3, 2))
        scores = soft_cap(xp, scores.reshape(B, nkv, -1, t1 - t0, s1 - s0), rows.softcap)
        if masked:
            scores = xp.where(self._block_mask(rows, t0, t1, k_at + s0, k_at + s1), scores,
                              -xp.inf)
        return scores

    def _one_block(self, qb, keys, values, rows, queries, k_at, block, empty_rows: bool):
        """(out, lse) of a query block whose keys are one block: the plain softmax (the
        reference's arithmetic), out in the queries' dtype."""
        xp = self.xp
        s0, s1, masked = block
        scores = self._scores(qb, keys, rows, queries, k_at, (s0, s1), masked)
        m = scores.max(axis=-1)
        if empty_rows:
            m = xp.where(xp.isfinite(m), m, 0.0)
        p = xp.exp(scores - m[..., None])
        total = p.sum(axis=-1)
        if empty_rows:
            seen = total > 0
            total = xp.where(seen, total, 1.0)
            m = xp.where(seen, m, -xp.inf)
        B, nkv, g, tq, sk = p.shape
        probs = (p / total[..., None]).astype(qb.dtype, copy=False).reshape(B, nkv, g * tq, sk)
        out = (probs @ values[:, :, s0:s1]).reshape(B, nkv, g, tq, -1)
        return out, m + xp.log(total)

    def forward(self, q, keys, values, rows: AttentionRows):
        return self.forward_train(q, keys, values, rows)[0]

    # ---- backward --------------------------------------------------------------------------

    def backward(self, dout, ctx):
        """(dq (B, T, heads, d), dk, dv (B, kv_heads, S, d)), recomputing each block's P."""
        xp = self.xp
        qs, keys, values, out, lse, rows = ctx
        B, T, nh, hd = dout.shape
        nkv = keys.shape[1]
        dtype = keys.dtype
        do = dout.reshape(B, T, nkv, nh // nkv, hd).transpose(0, 2, 3, 1, 4)  # (B, kv, g, T, d)
        D = (at_least_float32(xp, do) * at_least_float32(xp, out)).sum(axis=-1)  # (B, kv, g, T)
        dq, dk, dv = self.attend_backward(do, qs, keys, values, lse, D, rows)
        dq = (dq * score_scale(rows, hd)).astype(dtype, copy=False)
        dq = dq.transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)
        return dq, dk.astype(dtype, copy=False), dv.astype(dtype, copy=False)

    def attend_backward(self, do, qs, keys, values, lse, D, rows: AttentionRows,
                        q_at: int = 0, k_at: int = 0):
        """(dq (B, kv, g, T, d) before the scale, dk, dv (B, kv, S, d)) in the accumulator
        dtype: one segment pair's part of the gradients, from the output gradient ``do``
        (B, kv, g, T, d), the final lse and D = rowsum(dO * O) of the whole attention."""
        xp, (B, nkv, g, T, hd) = self.xp, qs.shape
        S = keys.shape[2]
        dtype = keys.dtype
        acc_dtype = accumulator(xp, dtype)
        dq = xp.zeros((B, nkv, g, T, hd), dtype=acc_dtype)
        dk = xp.zeros((B, nkv, S, hd), dtype=acc_dtype)
        dv = xp.zeros((B, nkv, S, hd), dtype=acc_dtype)
        for t0, t1, blocks in self._tiles(rows, T, S, q_at, k_at):
            tq = t1 - t0
            qb = qs[:, :, :, t0:t1].reshape(B, nkv, g * tq, hd)
            dob = do[:, :, :, t0:t1].reshape(B, nkv, g * tq, hd)
            for s0, s1, masked in blocks:
                kb, vb = keys[:, :, s0:s1], values[:, :, s0:s1]
                scores = self._scores(qb, keys, rows, (q_at + t0, q_at + t1), k_at, (s0, s1),
                                      masked)
                p = xp.exp(scores - lse[:, :, :, t0:t1, None])          # exp(-inf) = 0
                p16 = p.astype(dtype, copy=False).reshape(B, nkv, g * tq, s1 - s0)
                dv[:, :, s0:s1] += at_least_float32(xp, p16.transpose(0, 1, 3, 2) @ dob)
                dp = at_least_float32(xp, dob @ vb.transpose(0, 1, 3, 2)).reshape(
                    B, nkv, g, tq, s1 - s0)
                ds = soft_cap_grad(xp, p * (dp - D[:, :, :, t0:t1, None]), scores,
                                   rows.softcap).astype(dtype, copy=False)
                ds = ds.reshape(B, nkv, g * tq, s1 - s0)
                dq[:, :, :, t0:t1] += at_least_float32(xp, ds @ kb).reshape(B, nkv, g, tq, hd)
                dk[:, :, s0:s1] += at_least_float32(xp, ds.transpose(0, 1, 3, 2) @ qb)
        return dq, dk, dv
