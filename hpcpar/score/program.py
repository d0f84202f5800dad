"""What one pipeline stage computes in a scoring job (the executor's ``StageProgram``).

Each micro-batch is one forward pass over whole sequences (no KV cache: the keys are the
sequence's own). The last stage turns it into log p(ids[t] | ids[:t]) for every position,
a block of positions at a time, so that no rank ever holds a [rows, seq, vocab] array: the
vocabulary-parallel log-softmax of the training loss (one AllReduce of the row max and one of
the sums over tp), the target's logit taken where it lives.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..faults import fault_point
from ..generate.batching import MicroBatch
from ..model import DecoderStage
from ..parallel.layers import VocabParallelCrossEntropy
from ..ops import AttentionRows
from ..pipeline.schedule import Action

# float32 logits of one block of positions, per rank (the head's output is [rows, block,
# vocab/tp]): about 256 MiB, 512 positions of 16 rows of a 128k vocabulary at tp 1
LOGITS_BLOCK_BYTES = 256 << 20


class ScoringProgram:
    def __init__(self, stage: DecoderStage, mbs: list[MicroBatch], backend,
                 after_batch: Callable[[], None] | None = None):
        """``after_batch()``: called after each micro-batch's forward."""
        self.stage, self.mbs, self.backend, self.xp = stage, mbs, backend, backend.xp
        self.after_batch = after_batch
        self.offsets = np.cumsum([0] + [mb.size for mb in mbs])     # each mb's first row
        width = max((mb.length for mb in mbs), default=0)
        # this replica's rows, each from its first token: column t holds log p(ids[t] | ...)
        self.logprobs = np.full((sum(mb.size for mb in mbs), width), np.nan, dtype=np.float32)
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        if stage.last:
            self.loss = VocabParallelCrossEntropy(stage.ops, stage.cfg.vocab_size, stage.tp)

    # ---- StageProgram ----------------------------------------------------------------------

    def payload(self, a: Action):
        batch = self.mbs[a.mb]
        return (batch.size, batch.length, self.stage.hidden_size), self.stage.dtype

    def finished(self, mb: int) -> bool:
        return False

    def receive(self, a: Action, payload) -> None:
        self.inputs[a.mb] = payload

    def outgoing(self, a: Action):
        return self.outputs.pop(a.mb)

    def compute(self, a: Action) -> None:
        fault_point("score", a.mb + 1)
        stage, batch, xp = self.stage, self.mbs[a.mb], self.xp
        x = stage.embed(xp.asarray(batch.ids)) if stage.first else self.inputs.pop(a.mb)
        rows = AttentionRows.build(xp, batch.lengths, batch.lengths, from_start=True)
        y = stage.forward(x, rows, None)
        if stage.last:
            self._score(batch, stage.final_hidden(y))
        else:
            self.outputs[a.mb] = y
        if self.after_batch is not None:
            self.after_batch()

    # ---- the last stage ---------------------------------------------------------------------

    def _score(self, batch: MicroBatch, h) -> None:
        """Fill this micro-batch's rows of ``logprobs`` from the final hidden states h."""
        xp, head = self.xp, self.stage.head
        b, L = batch.ids.shape
        # the label of position t is the token at t + 1; -1 past each row's last token
        labels = batch.ids[:, 1:].copy()
        labels[np.arange(L - 1)[None, :] >= (batch.lengths - 1)[:, None]] = -1
        vocab_local = int(head.weight.data.shape[0])          # this block, padding included
        width = max(1, LOGITS_BLOCK_BYTES // (4 * b * vocab_local))
        first = int(self.offsets[batch.index])
        rows = slice(first, first + b)
        for c0 in range(0, L - 1, width):
            c1 = min(L - 1, c0 + width)
            logits = head.local_logits(h[:, c0:c1])                    # (b, c, vocab_i)
            nll = self.loss.token_losses(logits.reshape(b * (c1 - c0), -1),
                                         xp.asarray(labels[:, c0:c1].reshape(-1)))
            lp = -self.backend.to_host(nll).reshape(b, c1 - c0).astype(np.float32)
            self.logprobs[rows, c0 + 1:c1 + 1] = np.where(labels[:, c0:c1] >= 0, lp, np.nan)
