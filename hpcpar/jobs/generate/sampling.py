"""Choosing the next token: greedy, or temperature / top-k / top-p / min-p sampling, after
the penalties on tokens a row has seen.

Reproducible by seed and independent of the layout: the candidates are the same whatever the
tensor-parallel split (gathered from the vocab-parallel head in a canonical order), and the
random draw for a row comes from its own generator keyed by (seed, prompt index, step), and
the sample's index past a prompt's first (``--n``), not from a stream whose position depends
on how rows were batched. A prompt line with its own seed leaves its index out (vLLM's
per-request seed: the same line draws the same wherever it is).

The penalties change the logits before anything else (greedy too), each with the meaning of
the library that named it:
    repetition_penalty   transformers': a logit of a token in the row's prompt or its tokens
                         so far is divided by it when positive, multiplied when negative
    presence_penalty     OpenAI's (and vLLM's): subtracted once from the logit of every token
                         the row has generated
    frequency_penalty    OpenAI's: subtracted as many times as the row generated the token
min_p (transformers' and vLLM's) then keeps the candidates whose probability, after the
temperature, is at least min_p times the most likely one's. min_tokens (vLLM's) bans a row's
EOS and stop ids until it has that many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..inputs.sampling_settings import PromptSampling, SamplingParams


@dataclass
class History:
    """What each row of a step has seen: its prompt's ids and the tokens it generated so far
    (host int64 arrays, row by row), for the penalties; and the ids each may not generate yet
    (``banned``: its EOS and stop ids while it is below its ``min_tokens``)."""

    prompts: list[np.ndarray]
    generated: list[np.ndarray]
    banned: list[np.ndarray] | None = None


def adjusted_logits(head, local_logits, p: PromptSampling, history: History, xp, to_host):
    """``local_logits`` (rows, this rank's vocabulary) with the rows' penalties applied and
    their banned ids at -inf, in this rank's part of the vocabulary (``head.start`` to
    ``head.stop``): the few logits the penalties touch are gathered to the host, changed, and
    written back into a copy."""
    out = _penalized(head, local_logits, p, history, xp, to_host)
    if history.banned is not None and any(len(b) for b in history.banned):
        rows = np.concatenate([np.full(len(b), i) for i, b in enumerate(history.banned)])
        ids = np.concatenate(history.banned).astype(np.int64)
        mine = (ids >= head.start) & (ids < head.stop)
        if mine.any():
            out = out.copy() if out is local_logits else out
            out[xp.asarray(rows[mine]), xp.asarray(ids[mine] - head.start)] = -np.inf
    return out


def _penalized(head, local_logits, p: PromptSampling, history: History, xp, to_host):
    rows, cols, repeat, subtract = [], [], [], []
    for i in np.flatnonzero(p.penalized):
        prompt, generated = history.prompts[i], history.generated[i]
        ids, counts = np.unique(generated, return_counts=True)
        seen = np.union1d(prompt, ids) if p.repetition_penalty[i] != 1.0 else ids
        seen = seen[(seen >= head.start) & (seen < head.stop)]
        times = np.zeros(len(seen), np.int64)          # how often the row generated each
        found = np.minimum(np.searchsorted(ids, seen), max(len(ids) - 1, 0))
        if len(ids):
            times = np.where(ids[found] == seen, counts[found], 0)
        rows.append(np.full(len(seen), i))
        cols.append(seen - head.start)
        repeat.append(np.full(len(seen), p.repetition_penalty[i]))
        subtract.append(p.presence_penalty[i] * (times > 0) + p.frequency_penalty[i] * times)
    if not sum(map(len, rows)):
        return local_logits
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    repeat, subtract = np.concatenate(repeat), np.concatenate(subtract)
    where = (xp.asarray(rows), xp.asarray(cols))
    values = to_host(local_logits[where]).astype(np.float64)
    with np.errstate(over="ignore"):            # an extreme penalty: the logit at +-inf
        values = np.where(values > 0, values / repeat, values * repeat)   # transformers'
        values -= subtract                                    # order: repetition, then OpenAI's
    out = local_logits.copy()
    with np.errstate(over="ignore"):
        out[where] = xp.asarray(values.astype(out.dtype))
    return out


def needs_history(params: SamplingParams | PromptSampling, rows: np.ndarray) -> bool:
    """Whether any of prompts ``rows`` has a penalty or a ``min_tokens`` (its steps then need
    a ``History``)."""
    p = of_rows(params, np.asarray(rows, np.int64))
    return bool(p.penalized.any() or (p.min_tokens > 0).any())


def of_rows(params: SamplingParams | PromptSampling, rows: np.ndarray) -> PromptSampling:
    """The settings of prompts ``rows`` (global indices), row by row."""
    if isinstance(params, PromptSampling):
        return params.take(rows)
    return replace(PromptSampling.build(params, [{}] * len(rows)), prompt=rows)


def sample_from_candidates(values: np.ndarray, ids: np.ndarray,
                           params: SamplingParams | PromptSampling, rows: np.ndarray,
                           step) -> np.ndarray:
    """One token per row from candidate logits ``values`` and token ``ids`` (rows, n), sorted
    by logit descending; ``rows`` are the rows' global indices (none greedy; ``params``
    by that index), ``step`` the index of the token drawn (one for all rows, or each row's
    own). The cuts: top-k, then top-p, then min-p (transformers' order). Each draw is keyed
    by (seed, prompt, step), and the sample's index past the first; a prompt with a seed of
    its own leaves its index out (vLLM's per-request seed: the same line, the same draws,
    wherever it is)."""
    rows = np.asarray(rows, dtype=np.int64)
    p = of_rows(params, rows)
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64), (len(rows),))
    if len(rows) and (p.top_k > 0).all():
        values, ids = values[:, :p.top_k.max()], ids[:, :p.top_k.max()]
    probs = candidate_probabilities(values, p)
    cdf = np.cumsum(probs, axis=1)
    kept = (probs > 0).sum(axis=1)                       # the candidates left, a prefix
    out = np.empty(len(rows), dtype=np.int64)
    for i in range(len(rows)):
        key = [int(p.seed[i])]
        if not p.own_seed[i]:                    # a line's own seed: the same wherever it is
            key.append(int(p.prompt[i]))
        key.append(int(steps[i]))
        if p.sample[i]:
            key.append(int(p.sample[i]))
        u = np.random.default_rng(key).random() * cdf[i, -1]
        out[i] = ids[i, min(int(np.searchsorted(cdf[i], u, side="right")), kept[i] - 1)]
    return out


def candidate_probabilities(values: np.ndarray, p: PromptSampling) -> np.ndarray:
    """The probabilities sampling draws from, for candidate logits ``values`` (rows, n) sorted
    descending: the temperature's softmax cut by top-k, then top-p (renormalized), then
    min-p; zero for the candidates cut (a suffix of each row)."""
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
    cut = p.min_p[:, None] > 0.0        # the first candidate is the most likely one
    if cut.any():
        probs = np.where(cut & (probs < p.min_p[:, None] * probs[:, :1]), 0.0, probs)
        probs = np.where(cut, probs / probs.sum(axis=1, keepdims=True), probs)
    return probs


def next_tokens(head, local_logits, params: SamplingParams | PromptSampling, rows: np.ndarray,
                step, to_host, history: History | None = None) -> np.ndarray:
    """The next token of each row, from this rank's vocab-parallel logits (rows, vocab_i),
    penalized first where the rows' settings say (``history``: what they have seen).

    Greedy is a distributed argmax; top-k exchanges k candidates per rank (the largest k of
    the rows drawn); top-p or min-p without top-k needs the whole distribution and gathers it.
    Which of these run depends only on the rows' settings, so every tp rank calls the same
    collectives and returns the same tokens.
    """
    rows = np.asarray(rows, dtype=np.int64)
    p = of_rows(params, rows)
    if history is not None:
        local_logits = adjusted_logits(head, local_logits, p, history, head.xp, to_host)
    greedy = p.temperature == 0.0
    tokens = np.empty(len(rows), dtype=np.int64)
    drawn = ~greedy
    if greedy.all() or not (p.top_k[drawn] > 0).all():
        if greedy.any():
            tokens[:] = to_host(head.argmax(local_logits))
        if greedy.all():
            return tokens
    if (p.top_k[drawn] > 0).all():
        # one read for every row: a greedy row's token is its best candidate (the argmax's
        # tie rule: the lower id), a drawn row's candidates come with it
        values, ids = head.top_k(local_logits, int(p.top_k[drawn].max()))
        both = to_host(head.xp.stack([values, ids.astype(values.dtype)]))
        values, ids = both[0], both[1].astype(np.int64)    # exact: vocabularies < 2**24
        tokens[greedy] = ids[greedy, 0]
    else:
        full = to_host(head.full_logits(local_logits))                    # (rows, vocab)
        ids = np.argsort(-full, axis=1, kind="stable")
        values = np.take_along_axis(full, ids, axis=1)
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64), (len(rows),))
    tokens[drawn] = sample_from_candidates(values[drawn], ids[drawn], params, rows[drawn],
                                           steps[drawn])
    return tokens
