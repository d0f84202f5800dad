"""Bounded waits on the device path, checked with stand-ins for CuPy's events (no GPU
needed): a stream held up behind an NCCL operation whose peer is gone ends in CommTimeout
after the job's --timeout instead of blocking forever."""

from types import SimpleNamespace

import pytest

from hpcpar.parallel.device import waits
from hpcpar.parallel.device.backend import ArrayBackend
from hpcpar.parallel.errors import CommTimeout


class FakeEvent:
    """Records like ``cupy.cuda.Event``; ``done`` once ``ready`` is set."""
    ready = False

    def __init__(self, disable_timing=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    @property
    def done(self):
        return self.ready

    def synchronize(self):
        assert self.ready, "would block forever"


@pytest.fixture
def limit():
    before = waits.limit()
    waits.set_limit(0.3)
    yield
    waits.set_limit(before)


def _fake_cupy(ready: bool):
    event = type("Event", (FakeEvent,), {"ready": ready})
    return SimpleNamespace(cuda=SimpleNamespace(Event=event), ndarray=object)


def test_a_stream_that_never_drains_times_out(limit):
    stuck = ArrayBackend("cupy", _fake_cupy(ready=False), 0)
    with pytest.raises(CommTimeout, match="GPU waited 0.3 s"):
        stuck.synchronize()
    ArrayBackend("cupy", _fake_cupy(ready=True), 0).synchronize()   # returns at once


def test_an_nccl_request_is_bounded(limit):
    from hpcpar.parallel.comm.nccl import NcclCommunicator
    comm = NcclCommunicator.__new__(NcclCommunicator)      # no GPU: only the request logic
    comm.xp, comm.name, comm.rank = _fake_cupy(ready=False), "tp", 1
    with pytest.raises(CommTimeout, match="NCCL operation on the tp group"):
        comm._event_request().wait()
    comm.xp = _fake_cupy(ready=True)
    comm._event_request().wait()


def test_without_a_limit_the_event_is_waited_on_directly():
    """--timeout 0: the event's own blocking wait, never a poll of ``done``."""
    calls = []

    class Counted(FakeEvent):
        ready = True

        @property
        def done(self):
            calls.append("polled")
            return True

        def synchronize(self):
            calls.append("synchronized")

    before = waits.limit()
    waits.set_limit(0)
    try:
        waits.wait_event(Counted(), "x")
    finally:
        waits.set_limit(before)
    assert calls == ["synchronized"]
    waits.wait_event(Counted(), "x")                   # with a limit: polled instead
    assert calls == ["synchronized", "polled"]


class TimedEvent(FakeEvent):
    """An event stamped, when recorded, with the fake device's clock (milliseconds)."""
    device_ms = 0.0
    ready = True

    def record(self, stream=None):
        self.at = TimedEvent.device_ms


def _timed_cupy():
    return SimpleNamespace(cuda=SimpleNamespace(
        Event=TimedEvent, get_elapsed_time=lambda a, b: b.at - a.at), ndarray=object)


def test_device_time_is_read_from_events_once_settled_not_from_the_host():
    from hpcpar.parallel.device.backend import DeviceClock
    clock = DeviceClock(ArrayBackend("cupy", _timed_cupy(), 0))
    totals = [0.0, 0.0]
    start = clock.now()
    TimedEvent.device_ms += 250.0            # the kernels queued meanwhile take 250 ms
    clock.add(totals, 1, start)
    assert totals == [0.0, 0.0]              # nothing read yet: no synchronisation
    clock.settle()
    assert totals == [0.0, 0.25]


def test_queued_communication_is_timed_on_the_device():
    from hpcpar.parallel.device.backend import DeviceClock
    from hpcpar.parallel.comm.stats import CommStats
    clock = DeviceClock(ArrayBackend("cupy", _timed_cupy(), 0))
    stats = CommStats()
    start = clock.now()
    TimedEvent.device_ms += 40.0
    stats.record_on(clock, "tp.all_reduce", 1024, start)
    op = stats.ops["tp.all_reduce"]          # reading settles the clock
    assert (op.calls, op.bytes) == (1, 1024) and abs(op.seconds - 0.04) < 1e-12
