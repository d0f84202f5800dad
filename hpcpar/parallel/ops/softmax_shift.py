"""A whole sequence's softmax shift, known before any key is read (``KnownShift``): the
tiled attention's fast path for prefill, scoring and training's forward in float32/float64.

softmax is the same for any shift c, p = exp(S - c) / sum exp(S - c); the online softmax
keeps a running maximum only to keep exp in range. Here each query starts from a score it
certainly reaches (``reached_scores``) and moves up only in a span of keys whose scores a
Cauchy-Schwarz bound cannot keep within HEADROOM of it, so a span costs two GEMMs and one
exp2 (``TiledAttention._shifted_tile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..device.backend import host_array
from ..device.dtypes import accumulator
from .attention import AttentionRows

# exp2(S - c) stays at or below 2^HEADROOM (sums of a million such, times any sane value, stay
# far below float32's largest number, 3.4e38 = 2^128)
HEADROOM = 64.0
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class KnownShift:
    """The softmax's shift c known before any key is read, so that a span of keys costs two
    GEMMs and an exp2, with no maximum, no rescaling and no separate sum.

    softmax is the same for any shift: p = exp(S - c) / sum exp(S - c). The online softmax
    tracks the running maximum only to keep exp in range. Here each query starts from c = L,
    a score it is known to reach (its own key's; key 0's too without a sliding window), so
    the largest p is at least 1 and nothing underflows that matters; a span of keys whose
    scores may exceed c by more than HEADROOM (by the bound U = |q| max |k| over the span:
    Cauchy-Schwarz) takes its maximum and moves c up to it, so c never passes the query's
    largest score. With scores of a few units no span needs that. Then c folds into the
    scores' GEMM, [q, -c] [k, 1]^T = S - c, and the sum into the output's, exp(S - c) [v, 1]
    = (sum p v, sum p); the scores are in base 2 (q and c times log2 e), as NumPy's float32
    exp2 costs half of its exp.

    For a whole sequence's queries in float32 or float64; segments of a ring, decode steps
    (fewer queries than a block) and 16-bit work (a 16-bit [q, -c] would round c) keep the
    online softmax."""

    xp: object
    qs: object              # (B, kv, g, T, d) the scaled queries
    start: object           # (B, kv, g, T) L, each query's first c
    key_limit: object       # (B, kv, g, T) the key norm past which a score may overflow
    key_norms: object       # (B, kv, blocks) host: max |k| over each key block
    keys: object            # (B, kv, d + 1, S) [k, 1]^T
    values: object          # (B, kv, S, d + 1) [v, 1]
    block: int

    @staticmethod
    def build(xp, qs, keys, values, rows: AttentionRows, block: int, q_at: int, k_at: int,
              partial: bool) -> "KnownShift | None":
        """For a whole sequence's queries against its keys (``attend``'s arguments), or None
        where it does not apply."""
        B, nkv, g, T, hd = qs.shape
        exact = qs.dtype == keys.dtype == values.dtype == accumulator(xp, keys.dtype)
        if q_at or k_at or partial or T < block or not exact or rows.softcap is not None:
            return None           # (soft-capped scores are no GEMM's: the online softmax)
        S, dtype = keys.shape[2], qs.dtype
        norms = xp.zeros((B, nkv, -(-S // block) * block), dtype=dtype)
        norms[..., :S] = xp.sqrt(xp.einsum("bksd,bksd->bks", keys, keys))
        kx = xp.empty((B, nkv, hd + 1, S), dtype=dtype)
        kx[:, :, :hd] = keys.transpose(0, 1, 3, 2)
        kx[:, :, hd] = 1.0
        vx = xp.empty((B, nkv, S, hd + 1), dtype=dtype)
        vx[..., :hd] = values
        vx[..., hd] = 1.0
        start = reached_scores(xp, qs, keys, rows)
        q_norms = xp.sqrt(xp.einsum("bkgtd,bkgtd->bkgt", qs, qs)) * LOG2E
        # a query of norm ~0 (a padded row's) can reach no score: its limit is just large
        # (the floor eps, not tiny: a limit past float's range would warn of overflow)
        key_limit = (HEADROOM + start * LOG2E) / xp.maximum(q_norms, xp.finfo(dtype).eps)
        return KnownShift(xp, qs, start, key_limit,
                          host_array(norms.reshape(B, nkv, -1, block).max(axis=-1)),
                          kx, vx, block)

    def queries(self, t0: int, t1: int):
        """(B, kv, g tq, d + 1) [q, -c] log2 e of the queries [t0, t1), c at its start."""
        xp = self.xp
        B, nkv, g, _, hd = self.qs.shape
        qx = xp.empty((B, nkv, g, t1 - t0, hd + 1), dtype=self.qs.dtype)
        xp.multiply(self.qs[:, :, :, t0:t1], LOG2E, out=qx[..., :hd])
        xp.multiply(self.start[:, :, :, t0:t1], -LOG2E, out=qx[..., hd])
        return qx.reshape(B, nkv, g * (t1 - t0), hd + 1)

    def may_overflow(self, t0: int, t1: int, key_spans) -> list[bool]:
        """For each key span (s0, s1, masked): may some query of [t0, t1) score more than
        HEADROOM (base 2) above its starting c there, |q| log2 e max |k| - c log2 e >
        HEADROOM, that is max |k| > ``key_limit``? (c only grows: a safe answer.)"""
        limit = host_array(self.key_limit[:, :, :, t0:t1].min(axis=(2, 3)))    # (B, kv)
        return [bool((self.key_norms[..., s0 // self.block:-(-s1 // self.block)].max(-1)
                      > limit).any()) for s0, s1, _ in key_spans]


def spans(blocks, most: int):
    """Key blocks with runs of unmasked neighbours joined into spans of at most ``most``
    keys: fewer, larger GEMMs where no mask needs the block boundaries."""
    joined = []
    for s0, s1, masked in blocks:
        if (joined and not masked and not joined[-1][2] and joined[-1][1] == s0
                and s1 - joined[-1][0] <= most):
            joined[-1] = (joined[-1][0], s1, False)
        else:
            joined.append((s0, s1, masked))
    return joined


def reached_scores(xp, qs, keys, rows: AttentionRows):
    """(B, kv, g, T) a score each query certainly reaches, at most its largest: its score
    against its own position's key, and against its sequence's first key without a sliding
    window (key 0, or its document's first in packed rows: the sink a trained model attends
    to); a padding query sees key 0 alone."""
    B, nkv, g, T, hd = qs.shape
    S = keys.shape[2]
    t = xp.arange(T)
    position = rows.starts().astype(xp.int64)[:, None] + t[None, :]           # (B, T)
    padding = t[None, :] >= rows.q_lengths[:, None]
    own = xp.where(padding, 0, xp.minimum(position, S - 1))
    own_key = keys[xp.arange(B)[:, None], :, own]                          # (B, T, kv, d)
    reached = xp.einsum("bkgtd,btkd->bkgt", qs, own_key)
    if rows.window is None and rows.documents is not None:
        first = xp.where(padding, 0, rows.documents.starts[:, :T])            # (B, T)
        first_key = keys[xp.arange(B)[:, None], :, first]                  # (B, T, kv, d)
        reached = xp.maximum(reached, xp.einsum("bkgtd,btkd->bkgt", qs, first_key))
    elif rows.window is None:
        reached = xp.maximum(reached, xp.einsum("bkgtd,bkd->bkgt", qs, keys[:, :, 0]))
    return reached
