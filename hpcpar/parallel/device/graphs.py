"""A step captured once and replayed: CUDA graphs, and their stand-in that checks them on the CPU.

A decode step launches a few hundred small kernels, and on a GPU the host's time to launch them
is the step's time (launch-bound: ../shared/notes/gpu-h100.md). A CUDA graph records the
launches once and replays them with one call. ``StepGraph(backend, step)`` wraps a function of
no arguments whose inputs and state live in device buffers the caller writes in place (a
replay reads the same addresses) and which returns device arrays:

    graph = StepGraph(backend, step, "the decode step of 16 rows")
    out = graph()      # first call: the step eagerly (its result), then its capture
    out = graph()      # later calls: a replay; ``out`` is the same arrays, new contents

CuPy: the first call runs the step on a stream of the graph's own, its temporaries from a
memory pool of the graph's own (which lives as long as the graph: a replay writes the
addresses the capture saw) and its products through the planned GEMM (``ops/cuda/linear``);
then captures it on that stream; a replay is launched on the caller's current stream, so it
is ordered with the eager work around it.

The strict backend (the CPU's pretend device): the first call runs the step, then runs it
again under ``parallel.device.capture`` (a read, an upload or CuPy's matmul is refused, as capture
refuses them) and records it; its outputs must equal the first run's (a replay recomputes the
same step). A replay runs the step again, checked and compared with the record: the same
operations on the same shapes with the same host values, or a ``CaptureError`` naming the
first difference (a Python value that changed from step to step, which a real graph would
have frozen). Its results are copied into the captured outputs, as a CUDA replay leaves them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import capture
from ..errors import HpcparError


class StepGraph:
    def __init__(self, backend, step: Callable[[], object], what: str = "the step"):
        if not backend.on_device:
            raise HpcparError("CUDA graphs need a device backend: --backend cupy on a GPU "
                              "(or strict, the CPU's check of the GPU path)")
        self.step, self.what = step, what
        self._impl = _CudaGraph(step) if backend.is_gpu else _CheckedGraph(step, what)
        self.replays = 0

    def __call__(self):
        if not self._impl.captured:
            return self._impl.capture()
        self.replays += 1
        return self._impl.replay()

    @property
    def held_bytes(self) -> int:
        """Device bytes the graph's own pool holds (its temporaries and outputs; CuPy)."""
        pool = getattr(self._impl, "pool", None)
        return pool.total_bytes() if pool is not None else 0


class _CudaGraph:
    def __init__(self, step):
        import cupy
        self.cupy, self.step = cupy, step
        self.pool = cupy.cuda.MemoryPool()          # the graph's temporaries, for its life
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graph = self.outputs = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def capture(self):
        """The step eagerly on the graph's stream (this call's result: it also plans the
        GEMMs, builds cuDNN's graphs and fills the pool), then its capture there."""
        from ..ops.cuda.linear import capture_safe
        cupy, stream = self.cupy, self.stream
        caller = cupy.cuda.get_current_stream()
        stream.wait_event(caller.record())               # after the eager work before it
        with cupy.cuda.using_allocator(self.pool.malloc), capture_safe(), stream:
            result = self.step()
            stream.begin_capture()
            try:
                self.outputs = self.step()
            finally:
                graph = stream.end_capture()
        caller.wait_event(stream.record())               # the caller reads the result
        self.graph = graph
        return result

    def replay(self):
        self.graph.launch(stream=self.cupy.cuda.get_current_stream())
        return self.outputs


class _CheckedGraph:
    def __init__(self, step, what: str):
        self.step, self.what = step, what
        self.record = self.outputs = None

    @property
    def captured(self) -> bool:
        return self.record is not None

    def capture(self):
        result = self.step()
        record = capture.Capture(self.what)
        with capture.active(record):
            self.outputs = self.step()
        if not _equal(result, self.outputs):
            raise capture.CaptureError(f"{self.what} gave other results when run again on the "
                                       "same inputs: a graph's replay would not repeat it")
        self.record = record
        return result

    def replay(self):
        record = capture.Capture(self.what)
        with capture.active(record):
            result = self.step()
        difference = self.record.first_difference(record)
        if difference is not None:
            raise capture.CaptureError(f"{self.what} is not the computation captured ("
                                       f"{difference}): a CUDA graph would replay the first "
                                       "one; keep every host value the step uses fixed")
        _copy_into(self.outputs, result)
        return self.outputs


def _arrays(value) -> list:
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return [value] if hasattr(value, "shape") else []


def _equal(a, b) -> bool:
    from .strict_arrays import peek
    return all(np.array_equal(peek(x), peek(y), equal_nan=True)
               for x, y in zip(_arrays(a), _arrays(b)))


def _copy_into(outputs, result) -> None:
    """What a CUDA replay leaves: the new results in the captured outputs (uncounted: the
    replay's kernels wrote them)."""
    from .strict_arrays import peek
    for out, new in zip(_arrays(outputs), _arrays(result)):
        np.copyto(peek(out), peek(new))
