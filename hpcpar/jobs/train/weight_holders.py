"""Who holds which weights: the parameters of a training rank in groups, each summed over the
ranks that hold the same copies of them.

Without expert parallelism every weight of a (pp, tp) position is held by the dp x cp ranks:
one group. With ep, a MoE layer's experts are split over each ep group of dp replicas, so an
expert is held by the dp / ep replicas with the same ep rank (times cp): the ``edp`` group.
Dense weights (attention, norms, the router, the embedding) stay with dp x cp, as in
Megatron-Core. Each group has its own gradient buckets and, with ZeRO, its own optimizer
shards (stage 1: ``zero.ZeroShards``; stages 2 and 3, its units: ``sharded_units``); its
first rank counts its gradients in the norm and writes its weights (with stages 2 and 3 every
rank writes its pieces).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...parallel.comm import Communicator
from ...parallel.device.backend import memory_owner
from ...parallel.data_parallel.reducer import GradientReducer
from .params import Param
from .sharded_units import NotHeld, Transient, ShardedUnits
from .zero import ZeroShards


@dataclass
class Holders:
    """``params`` and ``comm``, the ranks holding the same copies (None: this rank alone);
    ``first``: this rank counts and writes them."""

    params: list[Param]
    comm: Communicator | None
    first: bool
    reducer: GradientReducer | None = None
    zero: ZeroShards | ShardedUnits | None = None

    @property
    def updated(self) -> list[Param]:
        """What the optimizer steps: the params, or with ZeRO this rank's segments of them."""
        return self.zero.segments if self.zero else self.params

    @property
    def sharded(self) -> ShardedUnits | None:
        """Stage 2 or 3's units, if the group has them."""
        return self.zero if isinstance(self.zero, ShardedUnits) else None

    def open(self, backward_groups: list[list[Param]], xp, bucket_bytes: int, zero: int,
             dtype=np.float32, transient: Transient | None = None, reader=None) -> None:
        """Buckets over the group (``backward_groups``: all params in the order their
        gradients complete, filtered to these) and ZeRO's shards of ``zero``'s stage
        (``reader``: where the pieces of params not loaded whole are read)."""
        if self.comm is None or self.comm.size == 1:
            return
        mine = {id(p) for p in self.params}
        groups = [kept for g in backward_groups if (kept := [p for p in g if id(p) in mine])]
        if zero >= 2:
            self.zero = ShardedUnits(self.comm, groups, xp, dtype, zero,
                                     transient or Transient(xp), reader)
            return
        self.reducer = GradientReducer(self.comm, groups, xp, bucket_bytes=bucket_bytes)
        self.zero = ZeroShards(self.comm, self.reducer, xp) if zero else None

    def slice_state(self, states: dict[str, dict], names) -> dict[str, dict]:
        """The checkpoint's optimizer state (``names``) of these params, as ``updated`` takes
        it (ZeRO-3's pieces of params not loaded whole: read alone)."""
        if self.sharded:
            return self.zero.slice_state(states, names)
        if self.zero:
            return self.zero.slice_state(states)
        return {p.name: states[p.name] for p in self.params if p.name in states}


def holders(params: list[Param], dp: Communicator | None, edp: Communicator | None,
            first: bool) -> list[Holders]:
    """One group of every param over ``dp`` (x cp), or with ep two: dense weights over dp and
    experts over ``edp``. ``first``: this rank is dp x cp's first."""
    if edp is None:
        return [Holders(list(params), dp, first)]
    dense = [p for p in params if p.spec.expert is None]
    experts = [p for p in params if p.spec.expert is not None]
    if not experts:                       # a LoRA run's without expert adapters
        return [Holders(dense, dp, first)]
    return [Holders(dense, dp, first), Holders(experts, edp, edp.rank == 0)]


def held_bytes(held: list[Holders], optimizer, transient: Transient | None,
               frozen=()) -> dict[str, int]:
    """This rank's bytes, each distinct buffer once: ``weights`` (the float32 masters held
    whole and the compute copy, or ZeRO-3's 16-bit pieces of it, and the ``frozen`` weights
    of a LoRA run's base), ``gradients`` (whole, or
    ZeRO 2/3's pieces), ``optimizer`` (its state, with ZeRO's float32 pieces of the weights
    it updates) and ``transient`` (ZeRO 2/3's gathered weights and micro-batch gradients at
    their most), as ``hpcpar plan`` predicts them."""
    seen: set[int] = set()

    def size(arrays) -> int:
        total = 0
        for a in arrays:
            if a is None or isinstance(a, NotHeld):
                continue
            owner = memory_owner(a)
            if id(owner) not in seen:
                seen.add(id(owner))
                total += int(owner.nbytes)
        return total

    params = [p for group in held for p in group.params]
    segments = [s for group in held if group.zero for s in group.zero.segments]
    pieces16 = [u.data_piece for group in held if group.sharded for u in group.sharded.units
                if u.data_piece is not u.master_piece]
    out = {"weights": size([p.data for p in params] + [p.master for p in params] + pieces16
                           + [w.data for w in frozen]),
           "gradients": size([p.grad for p in params] + [s.grad for s in segments])}
    out["optimizer"] = size([s.master for s in segments]
                            + [v for state in optimizer.state.values() for v in state.values()])
    out["transient"] = 0 if transient is None else transient.nbytes()
    return out
