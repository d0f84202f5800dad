"""What a generation keeps of each row: its new tokens and their count, and, where the row's
settings ask for them, the log-probabilities of its tokens and of its prompt's tokens.

One record (``RowResults``) for every place rows go: the programs fill it step by step, the
stream carries finished rows to rank 0 (``pack``: one int64 array, floats by their bits),
the output file holds one dataset per array (``arrays``), and the job's result hands it to
the caller. Every array's shape follows from a ``ResultShape``, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the output's dataset of each array of a ``Logprobs``, with its prefix ("" or "prompt_")
_LOGPROB_ARRAYS = ("logprobs", "top_logprobs", "top_token_ids")


@dataclass(frozen=True)
class ResultShape:
    """The widths of a run's results: new tokens per row, and for log-probabilities the
    alternatives kept per token (``logprobs``: the largest K a row asks, -1 when no row asks
    for any) and the same for the prompt's tokens over its ``prompt_width`` positions."""

    max_new_tokens: int
    logprobs: int = -1
    prompt_logprobs: int = -1
    prompt_width: int = 0           # the longest prompt (the prompt log-probs' columns)

    def specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype, object]]:
        """Each array's name -> (shape of one row, dtype, fill value)."""
        t, k = self.max_new_tokens, max(self.logprobs, 0)
        out = {"tokens": ((t,), np.dtype(np.int64), 0), "lengths": ((), np.dtype(np.int64), 0)}
        if self.logprobs >= 0:
            out |= _logprob_specs("", t, k)
        if self.prompt_logprobs >= 0:
            out |= _logprob_specs("prompt_", self.prompt_width, self.prompt_logprobs)
        return out


def _logprob_specs(prefix: str, width: int, k: int) -> dict:
    values, top, ids = (prefix + name for name in _LOGPROB_ARRAYS)
    return {values: ((width,), np.dtype(np.float32), np.nan),
            top: ((width, k), np.dtype(np.float32), np.nan),
            ids: ((width, k), np.dtype(np.int64), -1)}


@dataclass(frozen=True)
class Samples:
    """How many samples each prompt gets (``counts``, a line's ``n`` or the job's) and the
    rows they take: ``width`` per prompt (the most any prompt gets), row p * width + s for
    sample s of prompt p; the rows past a prompt's own count are never run."""

    counts: np.ndarray
    width: int = 1

    @property
    def present(self) -> np.ndarray:
        """(rows,) which rows are samples to run."""
        return (np.arange(self.width)[None, :] < self.counts[:, None]).reshape(-1)

    def prompt_of(self, row: int) -> tuple[int, int]:
        """(prompt, sample) of a row."""
        return divmod(int(row), self.width)


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of tokens, position by position, from the model's distribution
    (its logits' log-softmax, before temperature, penalties and cuts):

        values    (rows, positions)     float32  log p of the token there; NaN where none
        top       (rows, positions, K)  float32  the K largest log p there, descending
        top_ids   (rows, positions, K)  int64    their token ids; -1 past a row's own K
    """

    values: np.ndarray
    top: np.ndarray
    top_ids: np.ndarray

    def take(self, rows) -> "Logprobs":
        return Logprobs(self.values[rows], self.top[rows], self.top_ids[rows])


class RowResults:
    """Rows' results as named arrays of a ``ResultShape`` (``specs``), row by row."""

    def __init__(self, shape: ResultShape, arrays: dict[str, np.ndarray]):
        self.shape, self.arrays = shape, arrays

    @classmethod
    def empty(cls, rows: int, shape: ResultShape, pad_id: int = 0) -> "RowResults":
        """``rows`` rows of fill values (tokens: ``pad_id``)."""
        return cls(shape, {name: np.full((rows,) + row, pad_id if name == "tokens" else fill,
                                         dtype)
                           for name, (row, dtype, fill) in shape.specs().items()})

    def __len__(self) -> int:
        return len(self.arrays["lengths"])

    @property
    def tokens(self) -> np.ndarray:
        return self.arrays["tokens"]

    @property
    def lengths(self) -> np.ndarray:
        return self.arrays["lengths"]

    @property
    def logprobs(self) -> Logprobs | None:
        """The new tokens' log-probabilities (None: no row asked for them)."""
        return self._logprobs("")

    @property
    def prompt_logprobs(self) -> Logprobs | None:
        """The prompt tokens' log-probabilities (column t: token t of the prompt given the
        ones before; column 0 has none)."""
        return self._logprobs("prompt_")

    def _logprobs(self, prefix: str) -> Logprobs | None:
        if prefix + "logprobs" not in self.arrays:
            return None
        return Logprobs(*(self.arrays[prefix + name] for name in _LOGPROB_ARRAYS))

    def put_logprobs(self, prefix: str, rows: np.ndarray, columns: np.ndarray | None,
                     found: Logprobs) -> None:
        """``found`` into the ``prefix`` ("" or "prompt_") log-probabilities of rows
        ``rows``: at one column per row (``columns``), or from column 0 on (None)."""
        values, top, ids = (self.arrays[prefix + name] for name in _LOGPROB_ARRAYS)
        k = found.top.shape[-1]                       # the rows' largest K, maybe below ours
        if columns is not None:
            values[rows, columns] = found.values[:, 0]
            top[rows, columns, :k] = found.top[:, 0]
            ids[rows, columns, :k] = found.top_ids[:, 0]
        else:
            width = found.values.shape[1]
            values[rows, :width] = found.values
            top[rows, :width, :k] = found.top
            ids[rows, :width, :k] = found.top_ids

    def copy_prompt_rows(self, source: np.ndarray, target: np.ndarray) -> None:
        """Rows ``target`` take the prompt log-probabilities of rows ``source``."""
        for name in ("prompt_" + name for name in _LOGPROB_ARRAYS):
            if name in self.arrays:
                self.arrays[name][target] = self.arrays[name][source]

    def take(self, rows) -> "RowResults":
        """A copy of rows ``rows`` (indices or a mask)."""
        return RowResults(self.shape, {k: v[rows] for k, v in self.arrays.items()})

    def put(self, rows, other: "RowResults") -> None:
        """Rows ``rows`` of these results become ``other``'s rows, in order."""
        for name, values in other.arrays.items():
            self.arrays[name][rows] = values

    def pack(self, prompts: np.ndarray) -> np.ndarray:
        """[n, prompts (n), every array's bytes] as one int64 array (``unpack``'s)."""
        prompts = np.asarray(prompts, np.int64)
        body = b"".join(np.ascontiguousarray(a).tobytes() for a in self.arrays.values())
        body += bytes(-len(body) % 8)
        return np.concatenate([np.array([len(prompts)], np.int64), prompts,
                               np.frombuffer(body, np.int64)])

    @classmethod
    def unpack(cls, message: np.ndarray, shape: ResultShape) -> tuple[np.ndarray, "RowResults"]:
        """``pack``'s prompts and rows."""
        n = int(message[0])
        prompts, raw = message[1:1 + n], message[1 + n:].tobytes()
        arrays, at = {}, 0
        for name, (row, dtype, _) in shape.specs().items():
            count = n * int(np.prod(row, dtype=np.int64))
            arrays[name] = np.frombuffer(raw, dtype, count, at).reshape((n,) + row).copy()
            at += count * dtype.itemsize
        return prompts, cls(shape, arrays)
