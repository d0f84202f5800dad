"""The LM head with Gemma 2's final soft-capping: z = cap tanh(H W^T / cap).

Elementwise, so each tp rank caps its own vocabulary block and nothing more is exchanged;
padding stays -inf. Sampling, the top-k, log-probabilities and the vocab-parallel
cross-entropy read the capped logits as they read any others. Backward:

    dZ_raw = dZ (1 - t^2),  t = tanh(H W^T / cap)

with t recomputed from H (one more GEMM of the head's, in training only): the cross-entropy
overwrites in place the logits it is given, so they are not kept."""

from __future__ import annotations

from ..parallel.tensor_parallel.vocab import ParallelLMHead


class SoftCappedLMHead(ParallelLMHead):
    """``ParallelLMHead`` with the logits soft-capped at ``cap``."""

    def __init__(self, ops, weight, vocab_size: int, tp, cap: float):
        super().__init__(ops, weight, vocab_size, tp)
        self.cap = float(cap)

    def _tanh(self, h):
        """tanh(H W^T / cap) of this rank's block (float32 at least), -1 at the padding."""
        t = super().local_logits(h)
        t /= self.cap
        return self.xp.tanh(t, out=t)

    def local_logits(self, h):
        """(..., vocab_per_partition) cap tanh(logits / cap), padding at -inf."""
        z = self._tanh(h)
        z *= self.cap
        real = self.stop - self.start
        if real < z.shape[-1]:
            z[..., real:] = -self.xp.inf
        return z

    def backward(self, dlogits, h, sink=None):
        t = self._tanh(h)
        dlogits = dlogits.reshape(t.shape) * (1.0 - t * t)
        return super().backward(dlogits, h, sink)
