"""How a row ends: an EOS id, a stop string, or its own max_new_tokens.

Stop strings are text, so a row is read as text after each of its tokens: it ends once its
decoded text (special tokens skipped, as in the output) contains one of its stop strings,
the job's (``generate.stop``, ``--stop``) or its prompt line's own (``"stop"``). The tokens
up to the one that completed the string are kept; the text is cut before the string, as vLLM
does. Every stage that keeps the books decides alike: the decision is a pure function of the
row's tokens.
"""

from __future__ import annotations

import numpy as np

from ...models.chat import unicode_problem
from ...models.tokenizer import StoredTokenizer
from ...parallel.errors import HpcparError

FINISH_REASONS = ("eos", "stop", "length")


class StopStrings:
    """Each prompt's stop strings (by global prompt index), the tokenizer that reads a row's
    text, and each prompt's ``min_tokens``: as vLLM, a stop string counts only where it is
    completed by the row's min_tokens-th token or a later one (one its first min_tokens - 1
    tokens already hold does not end it, then or later)."""

    def __init__(self, per_prompt: list[tuple[str, ...]], tokenizer,
                 min_tokens: np.ndarray | None = None):
        self.per_prompt, self.tokenizer = per_prompt, tokenizer
        self.min_tokens = (np.zeros(len(per_prompt), np.int64) if min_tokens is None
                           else min_tokens)

    @classmethod
    def of(cls, job_stops: tuple[str, ...], own: list[tuple[str, ...] | None] | None,
           count: int, tokenizer, min_tokens: np.ndarray | None = None) -> "StopStrings | None":
        """The job's stop strings for every prompt, a line's own where it has them; None
        when no prompt has any. Stop strings need the tokenizer: the checkpoint's is read
        here, and one that cannot be is an error."""
        for k, stop in enumerate(job_stops):
            bad = unicode_problem(stop)
            if bad:
                raise HpcparError(f"--stop / generate.stop: stop string {k} holds invalid "
                                  f"Unicode ({bad}); give stop strings as UTF-8 text")
        own = own or [None] * count
        per_prompt = [tuple(job_stops) if o is None else tuple(o) for o in own]
        if not any(per_prompt):
            return None
        if isinstance(tokenizer, StoredTokenizer):
            tokenizer.require("stop strings are matched in the decoded text, and ")
        return cls(per_prompt, tokenizer, min_tokens)

    def text(self, ids) -> str:
        return decode_text(self.tokenizer, ids)

    def hit(self, prompt: int, ids) -> bool:
        """Whether the row of ``prompt`` with new tokens ``ids`` has met one of its strings."""
        if not self.per_prompt[prompt] or len(ids) < self.min_tokens[prompt]:
            return False
        return self._first(prompt, self.text(ids), ids) is not None

    def cut(self, prompt: int, text: str, ids) -> tuple[str, bool]:
        """``text`` (of new tokens ``ids``) up to its first stop string that counts, and
        whether one was there."""
        first = self._first(prompt, text, ids)
        return (text, False) if first is None else (text[:first], True)

    def _first(self, prompt: int, text: str, ids) -> int | None:
        """Where the first counting stop string of ``text`` starts: one that ends past the
        text of the row's first min_tokens - 1 tokens."""
        floor = self.min_tokens[prompt] - 1
        held = len(self.text(ids[:floor])) if floor > 0 else 0
        found = [i for s in self.per_prompt[prompt]
                 if (i := text.find(s, max(0, held - len(s) + 1))) >= 0]
        return min(found) if found else None


def finish_reasons(tokens: np.ndarray, lengths: np.ndarray, eos: tuple[int, ...],
                   stop_at_eos: bool, stopped: list[bool] | None = None,
                   stop_ids: list[np.ndarray] | None = None) -> list[str]:
    """Why each row ended: ``eos`` when its last new token is an EOS id it stopped at, else
    ``stop`` when its text met a stop string (``stopped``) or its last token is one of its
    ``stop_ids`` (each row's stop_token_ids), else ``length``: it reached its
    max_new_tokens."""
    last = tokens[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    ended = stop_at_eos & (lengths > 0) & np.isin(last, np.asarray(eos, dtype=np.int64))
    stopped = list(stopped or [False] * len(lengths))
    if stop_ids is not None:
        stopped = [s or (n > 0 and t in ids)
                   for s, n, t, ids in zip(stopped, lengths, last, stop_ids)]
    return ["eos" if e else "stop" if s else "length" for e, s in zip(ended, stopped)]


def decode_text(tokenizer, ids) -> str:
    """The text of token ids as the output holds it (special tokens skipped)."""
    return tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)


def decode_rows(tokenizer, tokens: np.ndarray, lengths: np.ndarray,
                stops: StopStrings | None, rows=None) -> tuple[list[str] | None, list[bool]]:
    """Each row's text (cut at a stop string) and whether a stop string ended it; no text
    without a tokenizer, or with the checkpoint's damaged one. ``rows``: the global prompt
    indices of ``tokens``' rows (all)."""
    rows = range(len(lengths)) if rows is None else rows
    if tokenizer is None or (isinstance(tokenizer, StoredTokenizer) and not tokenizer.usable()):
        return None, [False] * len(lengths)          # token ids only (a note says why)
    texts, stopped = [], []
    for r, row, n in zip(rows, tokens, lengths):
        text = decode_text(tokenizer, row[:n])
        if stops is not None:
            text, hit = stops.cut(r, text, row[:n])
        else:
            hit = False
        texts.append(text)
        stopped.append(hit)
    return texts, stopped
