"""Causal grouped-query attention in tiles, flash-attention's way: the same interface and
rows as ``ops.attention`` (per-row lengths, a KV cache, sliding windows), without the whole
(rows, heads, T, S) score matrix.

Queries and keys go in blocks. For each query block an online softmax keeps, per query, the
running maximum m and sum l of exp(score - m) in float32 (float64 in float64 work),
rescaling the output accumulated so far when m grows; key blocks that no row's query of
the block can see (above the causal diagonal, past every row's keys, or before every row's
window) are skipped, and only blocks that some mask cuts are masked. The backward keeps no
probabilities: it recomputes each block's from the saved log-sum-exp, lse = m + log l,

    P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  dS = P (dP - D),  D = rowsum(dO * O),
    dQ += dS K / sqrt(d),  dK += dS^T Q / sqrt(d)

Memory: the output, lse and one block of scores, O(B heads T d + block^2) per block row,
against the reference's O(B heads T S). The reference (``ops.attention.Attention``) stays
the test oracle.
"""

from __future__ import annotations

import math

from ..dtypes import at_least_float32
from .attention import Attention, AttentionRows, attention_mask, grouped

BLOCK = 128                    # queries and keys per tile


class TiledAttention(Attention):
    def __init__(self, xp, block: int = BLOCK):
        super().__init__(xp)
        self.block = block

    # ---- the tiles a query block reads -----------------------------------------------------

    def _tiles(self, rows: AttentionRows, T: int, S: int) -> list[tuple[int, int, list]]:
        """(t0, t1, key blocks) for each query block [t0, t1): the key blocks (s0, s1,
        masked) some query of the block of some row sees, ``masked`` when a mask cuts into
        the block for some query. The rows are read on the host once per call, and not at
        all when queries and keys fit one block (decode steps, short sequences)."""
        if T <= self.block and S <= self.block:
            return [(0, T, [(0, S, True)])]
        xp = self.xp
        starts = _host(xp, rows.starts())
        lo, hi = int(starts.min()), int(starts.max())
        q_len = _host(xp, rows.q_lengths)
        kv_len = _host(xp, rows.kv_lengths)
        kv_min, kv_max = int(kv_len.min()), int(kv_len.max())
        tiles = []
        for t0 in range(0, T, self.block):
            t1 = min(t0 + self.block, T)
            first, last = lo + t0, hi + t1 - 1            # the block's earliest, latest position
            top = min(S, last + 1, kv_max)                # keys past it: none sees them
            padded = bool((q_len < t1).any())             # padding queries see key 0
            bottom = 0                                    # keys before every window: unseen
            if rows.window is not None and not padded:
                bottom = max(0, first - rows.window + 1)
            blocks = []
            for s0 in range(bottom - bottom % self.block, top, self.block):
                s1 = min(s0 + self.block, S)
                # whole block visible to every query of every row of the block?
                inside = (s1 - 1 <= first and s1 <= kv_min and not padded
                          and (rows.window is None or s0 > last - rows.window))
                blocks.append((s0, s1, not inside))
            tiles.append((t0, t1, blocks))
        return tiles

    def _block_mask(self, rows: AttentionRows, t0: int, t1: int, s0: int, s1: int):
        """(B, 1, 1, tq, sk) which keys [s0, s1) the queries [t0, t1) see."""
        return attention_mask(self.xp, rows, t1 - t0, s1 - s0, t0, s0)

    # ---- forward ---------------------------------------------------------------------------

    def forward_train(self, q, keys, values, rows: AttentionRows):
        """(out (B, T, heads, d), ctx): ctx keeps q, k, v, the output and lse, not P."""
        xp, (B, T, nh, hd) = self.xp, q.shape
        acc_dtype = _accumulator(xp, q.dtype)
        qs, keys, values = grouped(q, keys, values, rows)
        nkv, S = keys.shape[1], keys.shape[2]
        g = nh // nkv
        qs = qs.reshape(B, nkv, g, T, hd)                                     # (B, kv, g, T, d)
        out = xp.zeros((B, nkv, g, T, hd), dtype=q.dtype)
        lse = xp.zeros((B, nkv, g, T), dtype=acc_dtype)
        for t0, t1, blocks in self._tiles(rows, T, S):
            tq = t1 - t0
            qb = qs[:, :, :, t0:t1].reshape(B, nkv, g * tq, hd)
            if len(blocks) == 1:          # one block: its softmax needs no running statistics
                self._one_block(qb, keys, values, rows, (t0, t1), blocks[0], out, lse)
                continue
            m = xp.full((B, nkv, g, tq), -xp.inf, dtype=acc_dtype)
            l = xp.zeros((B, nkv, g, tq), dtype=acc_dtype)
            acc = xp.zeros((B, nkv, g, tq, hd), dtype=acc_dtype)
            for s0, s1, masked in blocks:
                scores = self._scores(qb, keys, rows, (t0, t1), (s0, s1), masked)
                m_new = xp.maximum(m, scores.max(axis=-1))
                safe = xp.where(xp.isfinite(m_new), m_new, 0.0)          # rows seeing nothing
                p = xp.exp(scores - safe[..., None])
                rescale = xp.exp(xp.where(xp.isfinite(m), m, safe) - safe)
                l = l * rescale + p.sum(axis=-1)
                pv = (p.astype(q.dtype, copy=False).reshape(B, nkv, g * tq, s1 - s0)
                      @ values[:, :, s0:s1])
                acc = acc * rescale[..., None] + at_least_float32(xp, pv).reshape(
                    B, nkv, g, tq, hd)
                m = m_new
            out[:, :, :, t0:t1] = (acc / l[..., None]).astype(q.dtype, copy=False)
            lse[:, :, :, t0:t1] = m + xp.log(l)
        result = out.transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)
        return result, (qs, keys, values, out, lse, rows)

    def _scores(self, qb, keys, rows: AttentionRows, queries, block, masked: bool):
        """(B, kv, g, tq, sk) scores of query block ``queries`` against key block ``block``,
        at least float32, -inf where the mask hides a key."""
        xp = self.xp
        (t0, t1), (s0, s1) = queries, block
        B, nkv = qb.shape[:2]
        scores = at_least_float32(xp, qb @ keys[:, :, s0:s1].transpose(0, 1, 3, 2))
        scores = scores.reshape(B, nkv, -1, t1 - t0, s1 - s0)
        if masked:
            scores = xp.where(self._block_mask(rows, t0, t1, s0, s1), scores, -xp.inf)
        return scores

    def _one_block(self, qb, keys, values, rows, queries, block, out, lse) -> None:
        """A query block whose keys are one block: the plain softmax (the reference's
        arithmetic), its output and lse written into ``out`` and ``lse``."""
        xp = self.xp
        (t0, t1), (s0, s1, masked) = queries, block
        scores = self._scores(qb, keys, rows, queries, (s0, s1), masked)
        m = scores.max(axis=-1)
        p = xp.exp(scores - m[..., None])
        total = p.sum(axis=-1)
        B, nkv, g, tq, sk = p.shape
        probs = (p / total[..., None]).astype(out.dtype, copy=False).reshape(B, nkv, g * tq, sk)
        out[:, :, :, t0:t1] = (probs @ values[:, :, s0:s1]).reshape(B, nkv, g, tq, -1)
        lse[:, :, :, t0:t1] = m + xp.log(total)

    def forward(self, q, keys, values, rows: AttentionRows):
        return self.forward_train(q, keys, values, rows)[0]

    # ---- backward --------------------------------------------------------------------------

    def backward(self, dout, ctx):
        """(dq (B, T, heads, d), dk, dv (B, kv_heads, S, d)), recomputing each block's P."""
        xp = self.xp
        qs, keys, values, out, lse, rows = ctx
        B, T, nh, hd = dout.shape
        nkv, S = keys.shape[1], keys.shape[2]
        g = nh // nkv
        dtype = keys.dtype
        scale = 1.0 / math.sqrt(hd)
        do = dout.reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4)           # (B, kv, g, T, d)
        D = (at_least_float32(xp, do) * at_least_float32(xp, out)).sum(axis=-1)  # (B, kv, g, T)
        acc_dtype = _accumulator(xp, dtype)
        dq = xp.zeros((B, nkv, g, T, hd), dtype=acc_dtype)
        dk = xp.zeros((B, nkv, S, hd), dtype=acc_dtype)
        dv = xp.zeros((B, nkv, S, hd), dtype=acc_dtype)
        for t0, t1, blocks in self._tiles(rows, T, S):
            tq = t1 - t0
            qb = qs[:, :, :, t0:t1].reshape(B, nkv, g * tq, hd)
            dob = do[:, :, :, t0:t1].reshape(B, nkv, g * tq, hd)
            for s0, s1, masked in blocks:
                kb, vb = keys[:, :, s0:s1], values[:, :, s0:s1]
                scores = self._scores(qb, keys, rows, (t0, t1), (s0, s1), masked)
                p = xp.exp(scores - lse[:, :, :, t0:t1, None])          # exp(-inf) = 0
                p16 = p.astype(dtype, copy=False).reshape(B, nkv, g * tq, s1 - s0)
                dv[:, :, s0:s1] += at_least_float32(xp, p16.transpose(0, 1, 3, 2) @ dob)
                dp = at_least_float32(xp, dob @ vb.transpose(0, 1, 3, 2)).reshape(
                    B, nkv, g, tq, s1 - s0)
                ds = (p * (dp - D[:, :, :, t0:t1, None])).astype(dtype, copy=False)
                ds = ds.reshape(B, nkv, g * tq, s1 - s0)
                dq[:, :, :, t0:t1] += at_least_float32(xp, ds @ kb).reshape(B, nkv, g, tq, hd)
                dk[:, :, s0:s1] += at_least_float32(xp, ds.transpose(0, 1, 3, 2) @ qb)
        dq = (dq * scale).astype(dtype, copy=False).transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)
        return dq, dk.astype(dtype, copy=False), dv.astype(dtype, copy=False)


def _accumulator(xp, dtype):
    """Where sums and softmax statistics are kept: float32, or float64 for float64 work."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def _host(xp, a):
    """A small device array on the host (NumPy passes through)."""
    import numpy as np
    get = getattr(a, "get", None)
    return np.asarray(get() if get is not None else a)
