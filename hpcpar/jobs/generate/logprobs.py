"""Log-probabilities of a generation's tokens, read from the last stage's vocab-parallel logits
without gathering the vocabulary: per row one AllReduce(max) and one AllReduce(sum) of two
numbers over tp for the normalizer (``VocabParallelCrossEntropy.label_logprobs``) and K
candidates per rank for the top alternatives (``ParallelLMHead.top_k``). Only (rows, K)
numbers reach the host.

They are the model's distribution, the log-softmax of its logits, before temperature,
penalties and the cuts of sampling (vLLM's default, and what scoring the text gives).
Rows have their own K (a prompt line's ``logprobs``; -1: none); the collectives run for the
largest, so every tp rank makes the same calls whatever its rows ask.
"""

from __future__ import annotations

import numpy as np

from ...parallel.tensor_parallel.vocab import LOGITS_BLOCK_BYTES, VocabParallelCrossEntropy
from .results import Logprobs

MAX_LOGPROBS = 20          # alternatives per token, at most (vLLM's default max_logprobs)


class LogprobReader:
    """The last stage's reader (built on every tp rank of it at once: it agrees the
    vocabulary over tp)."""

    def __init__(self, head, to_host):
        self.head, self.xp, self.to_host = head, head.xp, to_host
        self.loss = VocabParallelCrossEntropy(head.ops, head.vocab_size, head.tp)

    def of_tokens(self, local_logits, tokens: np.ndarray, ks: np.ndarray) -> Logprobs:
        """Each row's log p of ``tokens`` (rows,) and its ``ks`` (rows,) most likely
        alternatives, from this rank's logits (rows, vocab_i), which are overwritten.
        A ``Logprobs`` of one position per row."""
        values, top, ids = self._read(local_logits, np.asarray(tokens, np.int64), ks)
        return Logprobs(values[:, None], top[:, None], ids[:, None])

    def of_prompts(self, h, ids: np.ndarray, lengths: np.ndarray, ks: np.ndarray) -> Logprobs:
        """Each prompt token's log p given the ones before it (column t: token t; column 0
        and past a row's end: none), and its ``ks`` alternatives, from the final hidden
        states ``h`` (b, L, hidden) of prompts ``ids`` (b, L), in blocks of positions of at
        most ``LOGITS_BLOCK_BYTES`` of logits."""
        head = self.head
        b, width = ids.shape
        k = max(int(ks.max(initial=-1)), 0)
        out = Logprobs(np.full((b, width), np.nan, np.float32),
                       np.full((b, width, k), np.nan, np.float32),
                       np.full((b, width, k), -1, np.int64))
        labels = np.full((b, width), -1, np.int64)          # column t scores token t + 1
        labels[:, :-1] = ids[:, 1:]
        labels[np.arange(width)[None, :] >= (np.asarray(lengths) - 1)[:, None]] = -1
        vocab_local = int(head.weight.data.shape[0])
        block = max(1, LOGITS_BLOCK_BYTES // (4 * b * vocab_local))
        for c0 in range(0, width - 1, block):
            c1 = min(c0 + block, width - 1)
            logits = head.local_logits(h[:, c0:c1]).reshape(b * (c1 - c0), -1)
            values, top, top_ids = self._read(logits, labels[:, c0:c1].reshape(-1),
                                              np.repeat(ks, c1 - c0))
            del logits                      # before the next block's: one block at a time
            out.values[:, c0 + 1:c1 + 1] = values.reshape(b, -1)
            out.top[:, c0 + 1:c1 + 1] = top.reshape(b, c1 - c0, k)
            out.top_ids[:, c0 + 1:c1 + 1] = top_ids.reshape(b, c1 - c0, k)
        return out

    def _read(self, logits, labels: np.ndarray, ks: np.ndarray):
        """(values (N,), top (N, K), top ids (N, K)) of logits (N, vocab_i) and labels (N,),
        K the largest of ``ks``; NaN / -1 where a row has none (label or K below 0) and past
        its own K. ``logits`` is overwritten."""
        xp, n = self.xp, len(labels)
        k = max(int(np.max(ks, initial=-1)), 0)
        top = np.full((n, k), np.nan, np.float32)
        top_ids = np.full((n, k), -1, np.int64)
        if k:                                          # before the logits are overwritten
            top_values, found = self.head.top_k(logits, k)
        values, normalizer = self.loss.label_logprobs(logits, xp.asarray(labels))
        values = self.to_host(values).astype(np.float32)
        if k:
            top = self.to_host(top_values - normalizer[:, None]).astype(np.float32)
            top_ids = self.to_host(found).astype(np.int64)
        none = (labels < 0) | (np.asarray(ks) < 0)
        beyond = (np.arange(k)[None, :] >= np.asarray(ks)[:, None]) | none[:, None]
        top[beyond], top_ids[beyond] = np.nan, -1
        values[none] = np.nan
        return values, top, top_ids
