"""What a job's communication cost: calls, bytes and seconds per group and operation."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class CommStats:
    """Calls, bytes and seconds per operation kind, for run reports.

    Bytes are the payload of the local buffer, as nccl-tests counts "size": the array reduced
    by all_reduce, the gathered output of all_gather, the input of reduce_scatter, the message
    of a send or receive. One ``CommStats`` may be shared by several communicators; each
    records under ``"<group>.<op>"``. Operations queued on a GPU stream (NCCL) are timed by
    a ``DeviceClock``, whose intervals are read when ``ops`` is."""

    def __init__(self):
        self._ops: dict[str, OpStats] = defaultdict(OpStats)
        self._clocks: list = []

    @property
    def ops(self) -> dict[str, OpStats]:
        for clock in self._clocks:
            clock.settle()
        return self._ops

    def record(self, key: str, nbytes: int, seconds: float) -> None:
        s = self._ops[key]
        s.calls += 1
        s.bytes += nbytes
        s.seconds += seconds

    def record_on(self, clock, key: str, nbytes: int, start) -> None:
        """Record a call whose time ``clock`` measures from ``start`` (its ``now()``)."""
        self.record(key, nbytes, 0.0)
        if clock not in self._clocks:
            self._clocks.append(clock)
        clock.add(_SecondsOf(self._ops[key]), 0, start)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self._ops.values())

    def reset(self) -> None:
        self._ops.clear()


class _SecondsOf:
    """``OpStats.seconds`` as the one-element list a ``DeviceClock`` adds into."""

    def __init__(self, op: OpStats):
        self._op = op

    def __getitem__(self, index: int) -> float:
        return self._op.seconds

    def __setitem__(self, index: int, value: float) -> None:
        self._op.seconds = value
