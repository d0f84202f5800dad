"""Choosing the next token: greedy, or temperature / top-k / top-p sampling.

Reproducible by seed and independent of the layout: the candidates are the same whatever the
tensor-parallel split (gathered from the vocab-parallel head in a canonical order), and the
random draw for a row comes from its own generator keyed by (seed, prompt index, step), not
from a stream whose position depends on how rows were batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...parallel.errors import HpcparError
from .. import settings


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
        """Each setting outside its range (the rules of ``hpcpar.jobs.settings``)."""
        return settings.problems("generate", vars(self))

    def check(self) -> None:
        if self.problems():
            raise HpcparError("; ".join(self.problems()))


@dataclass(frozen=True)
class PromptSampling:
    """Each prompt's sampling settings, by global prompt index: its own (a ``.jsonl`` line's
    ``temperature`` / ``top_k`` / ``top_p`` / ``seed``), else the job's."""

    temperature: np.ndarray     # float64; 0: greedy
    top_k: np.ndarray           # int64; 0: no cut
    top_p: np.ndarray           # float64; 1: no cut
    seed: np.ndarray            # int64

    @classmethod
    def build(cls, job: SamplingParams, own: list[dict]) -> "PromptSampling":
        """``own[i]``: prompt i's settings that differ from the job's (maybe none)."""
        n = len(own)
        out = cls(np.full(n, job.temperature, np.float64), np.full(n, job.top_k, np.int64),
                  np.full(n, job.top_p, np.float64), np.full(n, job.seed, np.int64))
        for i, prompt_own in enumerate(own):
            for key, value in prompt_own.items():
                getattr(out, key)[i] = value
        return out

    def take(self, rows: np.ndarray) -> "PromptSampling":
        return PromptSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                              self.seed[rows])


def of_rows(params: SamplingParams | PromptSampling, rows: np.ndarray) -> PromptSampling:
    """The settings of prompts ``rows`` (global indices), row by row."""
    if isinstance(params, PromptSampling):
        return params.take(rows)
    return PromptSampling.build(params, [{}] * len(rows))


def sample_from_candidates(values: np.ndarray, ids: np.ndarray,
                           params: SamplingParams | PromptSampling, rows: np.ndarray,
                           step) -> np.ndarray:
    """One token per row from candidate logits ``values`` and token ``ids`` (rows, n), sorted
    by logit descending; ``rows`` are the prompts' global indices (none greedy; ``params``
    by that index), ``step`` the index of the token drawn (one for all rows, or each row's
    own)."""
    rows = np.asarray(rows, dtype=np.int64)
    p = of_rows(params, rows)
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64), (len(rows),))
    if len(rows) and (p.top_k > 0).all():
        values, ids = values[:, :p.top_k.max()], ids[:, :p.top_k.max()]
    logits = values.astype(np.float64) / p.temperature[:, None]
    k = p.top_k[:, None]
    logits = np.where((k > 0) & (np.arange(logits.shape[1]) >= k), -np.inf, logits)
    probs = np.exp(logits - logits[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    nucleus = p.top_p[:, None] < 1.0
    if nucleus.any():
        before = np.cumsum(probs, axis=1) - probs        # mass of the better candidates
        probs = np.where(nucleus & (before >= p.top_p[:, None]), 0.0, probs)
        probs = np.where(nucleus, probs / probs.sum(axis=1, keepdims=True), probs)
    cdf = np.cumsum(probs, axis=1)
    kept = (probs > 0).sum(axis=1)                       # the candidates left, a prefix
    out = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        u = np.random.default_rng([int(p.seed[i]), int(row), int(steps[i])]).random() * cdf[i, -1]
        out[i] = ids[i, min(int(np.searchsorted(cdf[i], u, side="right")), kept[i] - 1)]
    return out


def next_tokens(head, local_logits, params: SamplingParams | PromptSampling, rows: np.ndarray,
                step, to_host) -> np.ndarray:
    """The next token of each row, from this rank's vocab-parallel logits (rows, vocab_i).

    Greedy is a distributed argmax; top-k exchanges k candidates per rank (the largest k of
    the rows drawn); top-p without top-k needs the whole distribution and gathers it. Which
    of these run depends only on the rows' settings, so every tp rank calls the same
    collectives and returns the same tokens.
    """
    rows = np.asarray(rows, dtype=np.int64)
    p = of_rows(params, rows)
    greedy = p.temperature == 0.0
    tokens = np.empty(len(rows), dtype=np.int64)
    if greedy.any():
        tokens[:] = to_host(head.argmax(local_logits))
    if greedy.all():
        return tokens
    drawn = ~greedy
    if (p.top_k[drawn] > 0).all():
        values, ids = head.top_k(local_logits, int(p.top_k[drawn].max()))
        values, ids = to_host(values), to_host(ids)
    else:
        full = to_host(head.full_logits(local_logits))                    # (rows, vocab)
        ids = np.argsort(-full, axis=1, kind="stable")
        values = np.take_along_axis(full, ids, axis=1)
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64), (len(rows),))
    tokens[drawn] = sample_from_candidates(values[drawn], ids[drawn], params, rows[drawn],
                                           steps[drawn])
    return tokens
