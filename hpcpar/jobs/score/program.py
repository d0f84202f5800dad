"""What one pipeline stage computes in a scoring job (the executor's ``StageProgram``).

Each micro-batch is one forward pass over whole sequences (no KV cache: the keys are the
sequence's own). The last stage turns it into log p(ids[t] | ids[:t]) for every position,
a block of positions at a time, so that no rank ever holds a [rows, seq, vocab] array: the
vocabulary-parallel log-softmax of the training loss (one AllReduce of the row max and one of
the sums over tp), the target's logit taken where it lives.

Rows that begin alike (an evaluation's context before each continuation) compute their
common beginning once (``shared_prefix``): a micro-batch that holds such rows takes two passes
through the pipeline, its prefixes and then the rest over their keys (``schedule``); every
row's log-probabilities are those of running it alone.

Under context parallelism (a ``cp`` group) each rank of the group runs its two chunks of
every row (``parallel.context_parallel.ring_attention``; rows shorter than the group are padded to
it) and scores those positions; ``gather_over_cp`` then gives every rank of the last stage the whole
rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ...models.decoder import DecoderStage
from ...models.kv_cache import CacheRows
from ...parallel.context_parallel.ring_attention import ContextShard, split_batch
from ...parallel.ops import AttentionRows
from ...parallel.pipeline.schedule import Action, Op, Schedule
from ...parallel.tensor_parallel.vocab import LOGITS_BLOCK_BYTES, VocabParallelCrossEntropy
from ..faults import fault_point
from ..inputs.batching import MicroBatch
from ..inputs.schedule import generation
from .shared_prefix import SharedPrefixes, shared_prefixes


# micro-batches per pipeline stage between the two passes of rows that share beginnings: their
# KV caches live that long (``ScoringProgram.schedule``)
SHARED_WINDOW = 2


def _groups_of(mb: MicroBatch) -> SharedPrefixes | None:
    """A micro-batch's groups of rows that begin alike, or None where it has none."""
    groups = shared_prefixes(mb.ids, mb.lengths)
    return groups if len(groups.leaders) else None


def scored_tokens(lengths) -> int:
    """Tokens scored in rows of these lengths: each but a row's first, which has no context."""
    return int(np.maximum(np.asarray(lengths) - 1, 0).sum())


class ScoringProgram:
    def __init__(self, stage: DecoderStage, mbs: list[MicroBatch], backend,
                 after_batch: Callable[[], None] | None = None, cp=None,
                 shares: bool = False):
        """``after_batch()``: called after each micro-batch's forward; ``cp``: the
        context-parallel group (a ``Communicator``), or None; ``shares``: rows that begin
        alike share their beginning's pass (``shared_prefix``; not under cp)."""
        self.stage, self.mbs, self.backend, self.xp = stage, mbs, backend, backend.xp
        self.after_batch, self.cp = after_batch, cp
        # each micro-batch's groups of rows that begin alike (None: its rows run whole); the
        # same on every stage, from the ids every rank has
        self.groups = [_groups_of(mb) if shares and cp is None else None for mb in mbs]
        self.caches: dict[int, object] = {}   # mb -> the KV cache its two passes share
        self.retired: set[int] = set()        # first stage: micro-batches done in one pass
        self.shared = 0                  # positions the shared passes did not compute (last)
        self.offsets = np.cumsum([0] + [mb.size for mb in mbs])     # each mb's first row
        width = max((mb.length for mb in mbs), default=0)
        # this replica's rows, each from its first token: column t holds log p(ids[t] | ...)
        self.logprobs = np.full((sum(mb.size for mb in mbs), width), np.nan, dtype=np.float32)
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        self.worked = 0                  # tokens scored so far (last stage)
        if stage.last:
            self.loss = VocabParallelCrossEntropy(stage.ops, stage.cfg.vocab_size, stage.tp)

    def schedule(self, num_stages: int) -> Schedule:
        """Every stage's actions: one forward pass per micro-batch, or, where some share
        beginnings, two (step 0 their prefixes, step 1 the rest over the prefixes' keys) for
        ``SHARED_WINDOW`` pipelines' worth of micro-batches at a time, so that the KV caches
        between a micro-batch's two passes are those of a window, not of the whole data. A
        micro-batch without shared rows ends after its first pass (``finished``)."""
        M = len(self.mbs)
        if not any(g is not None for g in self.groups):
            return generation(num_stages, M, 1)
        window = SHARED_WINDOW * num_stages if num_stages > 1 else 1   # one: no overlap
        out: Schedule = [[] for _ in range(num_stages)]
        for first in range(0, M, window):
            part = generation(num_stages, min(window, M - first), 2)
            for mine, actions in zip(out, part):
                mine += [replace(a, mb=a.mb + first) for a in actions]
        return out

    # ---- StageProgram ----------------------------------------------------------------------

    def payload(self, a: Action):
        if a.op in (Op.SEND_LOOP, Op.RECV_LOOP):      # a pass's turn: nothing travels back
            return (1,), np.dtype(np.int64)
        batch, groups = self.mbs[a.mb], self.groups[a.mb]
        H = self.stage.hidden_size
        if groups is not None:
            if a.step == 0:
                return (len(groups.leaders), int(groups.prefix.max()), H), self.stage.dtype
            own = batch.lengths - groups.starts
            return (batch.size, int(own.max()), H), self.stage.dtype
        shard = ContextShard.of(batch.length, self.cp)         # this rank's part, under cp
        here = batch.length if shard is None else shard.local_length()
        return (batch.size, here, H), self.stage.dtype

    def finished(self, mb: int) -> bool:
        return mb in self.retired

    def receive(self, a: Action, payload) -> None:
        if a.op is not Op.RECV_LOOP:
            self.inputs[a.mb] = payload

    def outgoing(self, a: Action):
        if a.op is Op.SEND_LOOP:
            return self.xp.zeros(1, dtype=np.int64)
        return self.outputs.pop(a.mb)

    def compute(self, a: Action) -> None:
        if a.step == 0:
            fault_point("score", a.mb + 1)
        batch, groups = self.mbs[a.mb], self.groups[a.mb]
        if groups is None:
            self._whole_pass(a.mb, batch)
        elif a.step == 0:
            self._prefix_pass(a.mb, batch, groups)
        else:
            self._own_pass(a.mb, batch, groups)
        if self.after_batch is not None:
            self.after_batch()

    def _whole_pass(self, mb: int, batch: MicroBatch) -> None:
        """The rows from their first token, split over cp where there is a cp group."""
        stage, xp = self.stage, self.xp
        ids, rows, shard = split_batch(xp, batch.ids, batch.lengths, self.cp)
        positions = np.arange(batch.length) if shard is None else shard.positions
        y = stage.forward(self._input(mb, ids), rows, None)
        if stage.first:
            self.retired.add(mb)
        if stage.last:
            first = int(self.offsets[batch.index])
            self._score(first + np.arange(batch.size), batch.ids, batch.lengths,
                        stage.final_hidden(y), np.broadcast_to(positions,
                                                               (batch.size, len(positions))))
            self.worked += scored_tokens(batch.lengths)
        else:
            self.outputs[mb] = y

    def _prefix_pass(self, mb: int, batch: MicroBatch, groups: SharedPrefixes) -> None:
        """Step 0 of rows that share beginnings (``shared_prefix``): each group's prefix once,
        into a KV cache, and scored for every row of the group; then every row's cache row
        holds its group's keys."""
        stage, xp = self.stage, self.xp
        lead, prefix = groups.leaders, groups.prefix
        own = batch.lengths - groups.starts
        # a cache row per row, long enough for the padding of the rows' own pass
        cache = self.caches[mb] = stage.new_cache(batch.size,
                                                  int((groups.starts + own.max()).max()))
        ids = np.zeros((len(lead), int(prefix.max())), dtype=np.int64)
        for g, (row, n) in enumerate(zip(lead, prefix)):
            ids[g, :n] = batch.ids[row, :n]
        rows = AttentionRows.build(xp, prefix, prefix, from_start=True)
        y = stage.forward(self._input(mb, ids), rows, CacheRows(cache, xp.asarray(lead)))
        members = np.flatnonzero(groups.group >= 0)
        sources = lead[groups.group[members]]
        cache.copy_rows(xp.asarray(sources), xp.asarray(members))
        if not stage.last:
            self.outputs[mb] = y
            return
        first = int(self.offsets[batch.index])
        self._score(first + lead, ids, prefix, stage.final_hidden(y),
                    np.broadcast_to(np.arange(ids.shape[1]), ids.shape))
        for row, source in zip(members, sources):    # the prefix's tokens: the group's
            n = int(prefix[groups.group[row]])
            self.logprobs[first + row, 1:n] = self.logprobs[first + source, 1:n]

    def _own_pass(self, mb: int, batch: MicroBatch, groups: SharedPrefixes) -> None:
        """Step 1: every row from its group's last prefix token on, over the group's keys
        (a row in no group from its first token), scored."""
        stage, xp, starts = self.stage, self.xp, groups.starts
        own = batch.lengths - starts
        ids = np.zeros((batch.size, int(own.max())), dtype=np.int64)
        for row in range(batch.size):
            ids[row, :own[row]] = batch.ids[row, starts[row]:batch.lengths[row]]
        rows = AttentionRows.build(xp, own, batch.lengths, from_start=False)
        y = stage.forward(self._input(mb, ids), rows, self.caches.pop(mb))
        if not stage.last:
            self.outputs[mb] = y
            return
        first = int(self.offsets[batch.index])
        self._score(first + np.arange(batch.size), batch.ids, batch.lengths,
                    stage.final_hidden(y), starts[:, None] + np.arange(ids.shape[1])[None, :])
        self.worked += scored_tokens(batch.lengths)
        self.shared += int(batch.lengths.sum() - groups.prefix.sum() - own.sum())

    def _input(self, mb: int, ids: np.ndarray):
        """A pass's input: the ids embedded on the first stage, else what it received."""
        stage = self.stage
        return stage.embed(self.xp.asarray(ids)) if stage.first else self.inputs.pop(mb)

    # ---- the last stage ---------------------------------------------------------------------

    def _score(self, out_rows: np.ndarray, ids: np.ndarray, lengths: np.ndarray, h,
               positions: np.ndarray) -> None:
        """Fill rows ``out_rows`` of ``logprobs`` from the final hidden states h (b, n) of
        positions ``positions`` (b, n) of rows whose tokens are ``ids`` (b, width; the first
        ``lengths``): column p + 1 holds log p(ids[p + 1] | ids[:p + 1])."""
        xp, head = self.xp, self.stage.head
        b, L = ids.shape
        # the label of position t is the token at t + 1; -1 past each row's last token
        following = np.full((b, max(L, int(positions.max()) + 1)), -1, dtype=np.int64)
        following[:, :L - 1] = ids[:, 1:]
        following[np.arange(following.shape[1])[None, :] >= (lengths - 1)[:, None]] = -1
        labels = np.take_along_axis(following, positions, axis=1)          # (b, n)
        scored = np.flatnonzero((labels >= 0).any(axis=0))                 # columns to run
        vocab_local = int(head.weight.data.shape[0])          # this block, padding included
        width = max(1, LOGITS_BLOCK_BYTES // (4 * b * vocab_local))
        for k0 in range(0, len(scored), width):
            cols = scored[k0:k0 + width]
            logits = head.local_logits(h[:, xp.asarray(cols)])             # (b, c, vocab_i)
            nll = self.loss.token_losses(logits.reshape(b * len(cols), -1),
                                         xp.asarray(labels[:, cols].reshape(-1)))
            lp = -self.backend.to_host(nll).reshape(b, len(cols)).astype(np.float32)
            r, c = np.nonzero(labels[:, cols] >= 0)
            self.logprobs[out_rows[r], positions[r, cols[c]] + 1] = lp[r, c]
            del logits, nll               # before the next block's: one block at a time

    def gather_over_cp(self) -> None:
        """Every rank of the cp group's scored positions in ``logprobs`` (last stage; each
        position is scored on exactly one rank of the group, NaN elsewhere)."""
        if self.cp is None or not self.stage.last:
            return
        mine = np.where(np.isnan(self.logprobs), -np.inf, self.logprobs)
        self.cp.on_host().all_reduce(mine, op="max")
        self.logprobs = np.where(np.isneginf(mine), np.nan, mine).astype(np.float32)
