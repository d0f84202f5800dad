"""Choosing the next token: greedy, or temperature / top-k / top-p sampling.

Reproducible by seed and independent of the layout: the candidates are the same whatever the
tensor-parallel split (gathered from the vocab-parallel head in a canonical order), and the
random draw for a row comes from its own generator keyed by (seed, prompt index, step), not
from a stream whose position depends on how rows were batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import HpcparError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0: greedy
    top_k: int = 0                # 0: no top-k cut
    top_p: float = 1.0            # 1: no nucleus cut
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problems(self) -> list[str]:
        out = []
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                out.append(f"{name} must be a finite number, got {getattr(self, name)}")
        if not 0 <= self.seed < 2 ** 63:
            out.append(f"seed must be in [0, 2^63), got {self.seed}")
        if out:
            return out
        if self.temperature < 0:
            out.append(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        return out

    def check(self) -> None:
        if self.problems():
            raise HpcparError("; ".join(self.problems()))


def sample_from_candidates(values: np.ndarray, ids: np.ndarray, params: SamplingParams,
                           rows: np.ndarray, step) -> np.ndarray:
    """One token per row from candidate logits ``values`` and token ``ids`` (rows, n), sorted
    by logit descending; ``rows`` are the prompts' global indices, ``step`` the index of the
    token drawn (one for all rows, or each row's own)."""
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64), (len(rows),))
    logits = values.astype(np.float64) / params.temperature
    if params.top_k:
        logits, ids = logits[:, :params.top_k], ids[:, :params.top_k]
    probs = np.exp(logits - logits[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    if params.top_p < 1.0:
        before = np.cumsum(probs, axis=1) - probs        # mass of the better candidates
        probs = np.where(before < params.top_p, probs, 0.0)
        probs /= probs.sum(axis=1, keepdims=True)
    cdf = np.cumsum(probs, axis=1)
    out = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        u = np.random.default_rng([params.seed, int(row), int(steps[i])]).random() * cdf[i, -1]
        out[i] = ids[i, min(int(np.searchsorted(cdf[i], u, side="right")), ids.shape[1] - 1)]
    return out


def next_tokens(head, local_logits, params: SamplingParams, rows: np.ndarray, step,
                to_host) -> np.ndarray:
    """The next token of each row, from this rank's vocab-parallel logits (rows, vocab_i).

    Greedy is a distributed argmax; top-k exchanges k candidates per rank; top-p without
    top-k needs the whole distribution and gathers it. Every tp rank returns the same tokens.
    """
    if params.greedy:
        return to_host(head.argmax(local_logits)).astype(np.int64)
    if params.top_k:
        values, ids = head.top_k(local_logits, params.top_k)
        return sample_from_candidates(to_host(values), to_host(ids), params, rows, step)
    full = to_host(head.full_logits(local_logits))                      # (rows, vocab)
    ids = np.argsort(-full, axis=1, kind="stable")
    return sample_from_candidates(np.take_along_axis(full, ids, axis=1), ids, params, rows, step)
