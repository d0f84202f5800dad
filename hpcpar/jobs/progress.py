"""What a job shows while it runs, on rank 0: tokens done (prompt and generated, scored, or
trained) out of the work known, tokens per second and an ETA.

On a terminal a tqdm bar. Elsewhere (``mpiexec`` and Slurm pipe the ranks' output, so rank 0's
stderr is no terminal) a ``progress:`` line every ``HPCPAR_PROGRESS_SECONDS`` (default 30; 0:
none), the first within a few seconds of the start, and one at the end, written by a thread of
their own so that a log shows a long prefill or step moving even while no count changes.

Counting by tokens rather than by prompts keeps the count moving while long rows decode
together and finish together. The work known may shrink as it runs (a generated row that ends
at EOS before its limit): the count is of real tokens, never of padding.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from time import perf_counter

from .settings import environment_number

FIRST_LINE_SECONDS = 3.0      # a log's first line comes this soon (or at the interval, if sooner)
RATE_LINES = 4                # the rate (and the ETA) is over the last this many lines,
RATE_SECONDS = 10.0           # and at least this many seconds: counts that come in lumps


class Progress:
    """Rank 0's display. ``update`` with absolute counts from the job's loop (cheap: no output
    between lines), ``close`` at the end; ``line()`` is what a log line says."""

    def __init__(self, what: str, total: int, interval: float | None = None,
                 terminal: bool | None = None, out=None):
        """``what``: the job's verb ("generating"); ``total``: tokens of work known."""
        self.what, self.total, self.done, self.detail = what, int(total), 0, ""
        self.out = out or sys.stderr
        self.interval = (environment_number("HPCPAR_PROGRESS_SECONDS")
                         if interval is None else interval)
        self.start = self.moved = perf_counter()       # moved: when the count last grew
        self.samples = deque([(self.start, 0)])         # (time, done) of the lines printed
        self.bar = self.thread = None
        self.closed = threading.Event()
        if self.out.isatty() if terminal is None else terminal:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, unit="tok", unit_scale=True, desc=what,
                            leave=False, file=self.out, dynamic_ncols=True)
        elif self.interval > 0:
            self.thread = threading.Thread(target=self._lines, name="hpcpar-progress",
                                           daemon=True)
            self.thread.start()

    def update(self, done: int, total: int | None = None, detail: str | None = None) -> None:
        """``done`` tokens so far (it never goes back), ``total`` the work now known, and
        ``detail`` a short count of the job's own units ("3/8 prompts")."""
        if total is not None:
            self.total = int(total)
        if detail is not None:
            self.detail = detail
        if done > self.done:
            self.done, self.moved = int(done), perf_counter()
        if self.bar is not None:
            self.bar.total = self.total
            if detail:
                self.bar.set_postfix_str(detail, refresh=False)
            self.bar.update(self.done - self.bar.n)

    def rate(self, now: float) -> float:
        """Tokens per second since the oldest line kept (``RATE_LINES``, ``RATE_SECONDS``;
        since the start before the first)."""
        then, done = self.samples[0]
        return (self.done - done) / max(now - then, 1e-9)

    def line(self, now: float | None = None) -> str:
        now = perf_counter() if now is None else now
        done, total = self.done, max(self.total, self.done)
        rate = self.rate(now)
        left = total - done
        eta = (_clock(left / rate) if rate > 0 else "unknown") if left else "0:00"
        return (f"progress: {self._counts()}, {rate:,.0f} tokens/s, ETA {eta}, "
                f"{_clock(now - self.start)} elapsed")

    def last_line(self) -> str:
        """The closing line: the work's time and rate, up to when the count last grew (the
        writing of outputs after it is not the work's)."""
        seconds = self.moved - self.start
        state = "finished" if self.done >= self.total else "ended"
        return (f"progress: {state}, {self._counts()} in {_clock(seconds)}, "
                f"{self.done / max(seconds, 1e-9):,.0f} tokens/s")

    def _counts(self) -> str:
        total = max(self.total, self.done)
        share = f" ({100 * self.done / total:.0f}%)" if total else ""
        detail = f"{self.detail}, " if self.detail else ""
        return f"{detail}{self.done:,}/{total:,} tokens{share}"

    def close(self, final: bool = True) -> None:
        """The bar closed, or in a log the lines stopped and (``final``) the closing line
        (``last_line``). Only the first call does anything."""
        if self.closed.is_set():
            return
        self.closed.set()
        if self.bar is not None:
            self.bar.close()
        if self.thread is not None:
            self.thread.join()
            if final:
                self._print(final=True)

    def _lines(self) -> None:
        wait = min(FIRST_LINE_SECONDS, self.interval)
        while not self.closed.wait(wait):
            self._print()
            wait = self.interval

    def _print(self, final: bool = False) -> None:
        now = perf_counter()
        text = self.last_line() if final else self.line(now)
        self.samples.append((now, self.done))
        while (len(self.samples) > RATE_LINES + 1
               and now - self.samples[1][0] >= RATE_SECONDS):
            self.samples.popleft()
        try:
            print(text, file=self.out, flush=True)
        except (OSError, ValueError):       # the log went away (a closed pipe): no display
            self.closed.set()


def _clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
