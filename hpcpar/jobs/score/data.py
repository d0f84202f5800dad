"""The sequences a scoring job reads: a ``.npy`` of token ids [rows, seq] whose rows may be
left-padded with negative ids, or a ``.jsonl`` of ``{"ids": [...]}`` / ``{"text": "..."}``
lines. Each row's output columns line up with its input: a ``.npy`` row's first real token
sits at column ``offsets[row]`` of ``token_logprobs``; ``.jsonl`` rows start at column 0."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...models.config import ModelConfig
from ...parallel.errors import HpcparError
from ..inputs.prompts import Prompts, load_prompts
from ..npy import read_npy


@dataclass(frozen=True)
class ScoreData:
    ids: list[np.ndarray]           # each row's real tokens (int64), padding removed
    offsets: np.ndarray             # (rows,) output column of each row's first token
    width: int                      # columns of the output: the input's seq

    def __len__(self) -> int:
        return len(self.ids)


def load_score_data(path: str | Path, tokenizer=None) -> ScoreData:
    path = Path(path)
    if path.is_file() and path.suffix not in (".npy", ".jsonl", ".json"):
        raise HpcparError(f"{path}: scoring data must be a .npy of token ids [rows, tokens] or "
                          f"a .jsonl with {{\"ids\": [...]}} or {{\"text\": \"...\"}} per line, "
                          f"not {path.suffix or 'a file without suffix'}")
    if path.suffix == ".npy" and path.is_file():
        return _from_padded(path, read_npy(path, "the rows' token ids (int, [rows, tokens])"))
    prompts: Prompts = load_prompts(path, tokenizer)    # the .jsonl reader and its errors
    width = max(len(p) for p in prompts.ids)
    return ScoreData(prompts.ids, np.zeros(len(prompts), dtype=np.int64), width)


def _from_padded(path: Path, array: np.ndarray) -> ScoreData:
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise HpcparError(f"{path}: expected an integer array [rows, seq], got {array.dtype} "
                          f"{list(array.shape)}")
    if array.size == 0:
        raise HpcparError(f"{path}: holds no sequences (shape {list(array.shape)})")
    ids, offsets = [], []
    for n, row in enumerate(array.astype(np.int64)):
        pad = int(np.argmax(row >= 0)) if (row >= 0).any() else row.size
        if pad == row.size:
            raise HpcparError(f"{path}: row {n} is all padding (negative ids); every row needs "
                              "at least one token")
        if (row[pad:] < 0).any():
            t = pad + int(np.argmax(row[pad:] < 0))
            raise HpcparError(f"{path}: row {n} has a negative id at column {t}, after its "
                              "first token; pad on the left only (negative ids before the "
                              "tokens)")
        ids.append(row[pad:])
        offsets.append(pad)
    return ScoreData(ids, np.asarray(offsets, dtype=np.int64), array.shape[1])


def check_score_data(data: ScoreData, cfg: ModelConfig, source: str) -> None:
    """Every id is in the vocabulary, every row fits the model's positions, and some row
    has a token to score (a row's first token has no context, so is never scored)."""
    if all(len(row) < 2 for row in data.ids):
        raise HpcparError(f"{source}: every row holds a single token, and a row's first token "
                          "is never scored (it has no context): nothing to score; give rows "
                          "of two or more tokens")
    for n, row in enumerate(data.ids):
        bad = row[(row < 0) | (row >= cfg.vocab_size)]
        if bad.size:
            raise HpcparError(f"{source}: row {n} holds token id {int(bad[0])}, outside the "
                              f"model's vocabulary [0, {cfg.vocab_size})")
        positions, field = cfg.positions
        if len(row) > positions:
            raise HpcparError(f"{source}: row {n} has {len(row)} tokens, more than the model's "
                              f"{field}; split it into shorter rows")
