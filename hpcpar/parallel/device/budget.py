"""What a GPU would be asked to do, counted without one: on the strict device backend
(``HPCPAR_BACKEND=strict``, ``parallel.device.strict_arrays``) every array operation goes through
one wrapper, so it can count what makes a GPU run slow:

    ops          array operations that compute: each is one kernel launch on a GPU (a view,
                 a reshape or a transpose computes nothing and is not one)
    reads        device-to-host reads: ``.get()``, ``.item()``, ``.tolist()``, ``int()``,
                 ``float()``, ``bool()`` of a device array; each waits for the device (a sync)
    uploads      host-to-device copies (``xp.asarray`` of host data, ``x[...] = host``)
    staged       copies through the host for an MPI that is not CUDA-aware (a CUDA-aware
                 MPI or NCCL makes none): counted apart from the reads and uploads
    allocations  new device arrays, and their bytes
    peak bytes   the most device bytes alive at once (arrays made while counting)

Counts go to every phase open at the time (``phase("decode")`` around a decode step,
``phase("layer")`` around each decoder layer inside it), and each phase keeps one
``Counts`` per time it ran, under its path ("decode", "decode/layer"). Off, a counted call
site costs one read of a module variable.

    budget = Budget()
    with budget.counting():
        ...                                     # a job on the strict backend
    budget.per_run("decode")                    # Counts of each decode step
    budget.per_run("decode/layer")              # of each layer of each decode step
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

_current: "Budget | None" = None


@dataclass
class Counts:
    ops: int = 0
    reads: int = 0
    uploads: int = 0
    staged: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    peak_bytes: int = 0          # live bytes at this phase's peak (all phases' arrays)


class Budget:
    """The counts of one run, by phase (see the module docstring)."""

    def __init__(self):
        self.live = 0                            # device bytes alive (made while counting)
        self._owners: dict[int, int] = {}        # id of the memory's owner -> its bytes
        self.peak = 0
        self.total = Counts()
        self.runs: dict[str, list[Counts]] = {}
        self._open: list[Counts] = [self.total]
        self._names: list[str] = []
        self._staging = False
        self._fused = 0                       # inside a fused kernel's reference: not counted

    @contextmanager
    def counting(self):
        """Count the array operations of the block (one ``Budget`` at a time)."""
        global _current
        if _current is not None:
            raise RuntimeError("a device budget is already counting")
        _current = self
        try:
            yield self
        finally:
            _current = None

    @contextmanager
    def phase(self, name: str):
        counts = Counts(peak_bytes=self.live)
        self._open.append(counts)
        self._names.append(name)
        path = "/".join(self._names)
        try:
            yield counts
        finally:
            self._open.pop()
            self._names.pop()
            self.runs.setdefault(path, []).append(counts)

    def per_run(self, name: str) -> list[Counts]:
        return self.runs.get(name, [])

    # ---- what the strict backend reports ------------------------------------------------

    def op(self) -> None:
        if self._fused:
            return
        for c in self._open:
            c.ops += 1

    def read(self) -> None:
        self._transfer("reads")

    def upload(self) -> None:
        self._transfer("uploads")

    def _transfer(self, kind: str) -> None:
        if self._fused:         # a kernel's reference (its tiles to skip): the device's work
            return
        kind = "staged" if self._staging else kind        # a communicator's, counted apart
        for c in self._open:
            setattr(c, kind, getattr(c, kind) + 1)

    @contextmanager
    def staging(self):
        """The copies of the block are a communicator's staging through the host."""
        self._staging = True
        try:
            yield
        finally:
            self._staging = False

    def allocated(self, array) -> None:
        """A new device array (a NumPy array under the strict backend): counted, and the
        bytes of the memory it views alive until that memory is collected. The memory's
        owner is what is watched, not the array handed back: a kernel's output is often a
        view (a product reshaped), and views taken of it (q, k, v split from the qkv GEMM's
        output) keep the owner alive, not that view; a device frees the memory only then."""
        if self._fused:
            return
        nbytes = int(array.nbytes)
        for c in self._open:
            c.allocations += 1
            c.allocated_bytes += nbytes
        owner = _owner(array)
        if id(owner) in self._owners:            # memory counted already (several views)
            return
        self._owners[id(owner)] = held = int(owner.nbytes)
        self.live += held
        self.peak = max(self.peak, self.live)
        for c in self._open:
            c.peak_bytes = max(c.peak_bytes, self.live)
        weakref.finalize(owner, self._freed, id(owner))

    def _freed(self, key: int) -> None:
        self.live -= self._owners.pop(key)


@contextmanager
def staging():
    """``Budget.staging`` of the budget counting now; nothing when none is."""
    if _current is None:
        yield
    else:
        with _current.staging():
            yield


@contextmanager
def fused(inputs, arrays_of):
    """The block is one device kernel (``ops.counted``): one operation, and its outputs
    (the arrays appended to the list it yields that are not views of ``inputs``) new
    arrays; what it does inside is not counted. ``arrays_of(value)``: the arrays in a
    (nested) value (the strict backend's). Nothing when no budget counts."""
    outputs: list = []
    b = _current
    if b is None:
        yield outputs
        return
    b._fused += 1
    try:
        yield outputs
    finally:
        b._fused -= 1
    b.op()
    held = arrays_of(inputs)
    for array in arrays_of(outputs):
        if not any(array is a or _shares(array, a) for a in held):
            b.allocated(array)


def _owner(array):
    """The array that owns ``array``'s memory (itself, or the base its views lead to)."""
    while isinstance(getattr(array, "base", None), np.ndarray):
        array = array.base
    return array


def _shares(a, b) -> bool:
    return bool(np.may_share_memory(a, b))


def current() -> Budget | None:
    """The budget counting now, or None."""
    return _current


@contextmanager
def phase(name: str):
    """``Budget.phase`` of the budget counting now; nothing when none is."""
    if _current is None:
        yield None
    else:
        with _current.phase(name) as counts:
            yield counts
