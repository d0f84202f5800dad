"""What a generation job shows while it runs, on rank 0: prompts finished out of the prompts
this run generates, and new tokens per second. On a terminal a tqdm bar; in a batch log one
line every ``HPCPAR_PROGRESS_SECONDS`` (default 30; 0: none), so a Slurm log shows that a
long job moves without filling up.

Rank 0 is the first stage of replica 0: it sees that replica's tokens as they come back to
be embedded, and the finished rows of every replica about every second (``generate.stream``).
In between, replica 0's rows are counted at the share of the whole they stand for (dp
replicas split the prompts evenly and run the same model), and the bar shows that or the
rows rank 0 holds, whichever is ahead, so it never goes back. The token rate is replica
0's, scaled the same way."""

from __future__ import annotations

import sys
from time import perf_counter

from ..settings import environment_number


class Progress:
    def __init__(self, total: int, share: float, interval: float | None = None,
                 terminal: bool | None = None, out=None):
        """``total`` prompts; ``share`` the fraction of them replica 0 runs."""
        self.total, self.share = total, share
        self.done = 0               # prompts finished in waves already collected
        self.replica = 0            # replica 0's rows finished in the current wave
        self.saved = 0              # every replica's rows of the current wave rank 0 holds
        self.tokens = 0
        self.start = self.last = perf_counter()
        self.out = out or sys.stderr
        if interval is None:
            interval = environment_number("HPCPAR_PROGRESS_SECONDS")
        self.interval = interval
        terminal = self.out.isatty() if terminal is None else terminal
        self.bar = None
        if terminal:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="prompt", desc="generating", leave=False,
                            file=self.out)

    @property
    def finished(self) -> int:
        """Prompts finished: collected waves, plus the current wave's rows rank 0 holds or
        replica 0's scaled up, whichever is ahead (both only grow)."""
        current = max(self.saved, round(self.replica / self.share))
        return min(self.total, self.done + current)

    def rows(self, finished: int, tokens: int) -> None:
        """Replica 0 recorded ``tokens`` new tokens, and ``finished`` of its rows ended."""
        self.replica += finished
        self.tokens += tokens
        self._show()

    def rows_saved(self, prompts: int) -> None:
        """Rank 0 received ``prompts`` finished rows of the current wave (any replica)."""
        self.saved += prompts
        self._show()

    def wave_done(self, prompts: int) -> None:
        """A wave of ``prompts`` is collected: every replica's rows count exactly."""
        self.done += prompts
        self.replica = self.saved = 0
        self._show()

    def _show(self) -> None:
        now = perf_counter()
        rate = self.tokens / self.share / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.n = self.finished
            self.bar.set_postfix_str(f"{rate:,.0f} new tok/s", refresh=False)
            self.bar.refresh()
        elif self.interval > 0 and now - self.last >= self.interval:
            self.last = now
            print(f"progress: {self.finished}/{self.total} prompts, {rate:,.0f} new tokens/s, "
                  f"{now - self.start:.0f} s", file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
