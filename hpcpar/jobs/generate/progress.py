"""A generation job's progress on rank 0 (``jobs.progress``): the prompt tokens prefilled and
the tokens generated, out of the prompts' tokens and each prompt's ``max_new_tokens``.

Every replica's owner reports its replica's count with the finished rows it streams to rank 0
(``generate.stream``, about every second), so the count is every replica's, exact to within
that; replica 0's rank 0 counts as its steps come. A row that ends before its limit (EOS, a
stop string) takes its unused tokens off the work known when rank 0 receives it.
"""

from __future__ import annotations

import numpy as np

from ..progress import Progress


class GenerationProgress:
    def __init__(self, checked, prompts: np.ndarray, **display):
        """``checked``: the run's ``CheckedGeneration``; ``prompts``: the indices this run
        generates for; ``display``: ``Progress``'s options."""
        self.limits = np.asarray(checked.limits, np.int64)
        lengths = np.asarray(checked.prompts.lengths, np.int64)
        total = int(lengths[prompts].sum() + self.limits[prompts].sum())
        self.prompts, self.finished = len(prompts), 0
        # with n samples a prompt is several rows (``checked.samples``): count what finishes
        self.unit = "prompts" if checked.samples.width == 1 else "sample rows"
        self.earlier = 0                # tokens of the waves already collected
        self.cache = ""                 # the paged cache's figures of rank 0's replica
        self.replicas: dict[int, int] = {}     # the current wave: replica -> tokens done
        self.display = Progress("generating", total, **display)
        self._show()

    def heard(self, dp_rank: int, tokens: int) -> None:
        """Replica ``dp_rank``'s tokens done in the current wave, from its owner, or for
        replica 0 from rank 0's own books (its first stage's, a step behind the owner's and
        never late): the larger count stands."""
        self.replicas[dp_rank] = max(self.replicas.get(dp_rank, 0), tokens)
        self._show()

    def paged(self, pool: tuple[int, int, int], prefix: tuple[int, int]) -> None:
        """The paged cache of rank 0's replica: (blocks, the most in use, rows preempted) and
        (prompt tokens admitted, those served from its prefix cache)."""
        blocks, peak, preempted = pool
        if blocks:
            self.cache = (f"; replica 0: prefix cache {prefix[1] / max(prefix[0], 1):.0%}, "
                          f"{peak}/{blocks} blocks, {preempted} preempted")

    def rows_finished(self, prompts: np.ndarray, lengths: np.ndarray) -> None:
        """Rank 0 received these finished rows: their unused tokens are no longer work."""
        self.finished += len(prompts)
        unused = int((self.limits[prompts] - lengths).sum())
        self._show(total=self.display.total - unused)

    def wave_done(self) -> None:
        """Every replica's final count of the wave is in."""
        self.earlier += sum(self.replicas.values())
        self.replicas.clear()
        self._show()

    @property
    def done(self) -> int:
        return self.earlier + sum(self.replicas.values())

    def close(self, final: bool = True) -> None:
        self.display.close(final)

    def _show(self, total: int | None = None) -> None:
        self.display.update(self.done, total,
                            f"{self.finished}/{self.prompts} {self.unit}{self.cache}")
