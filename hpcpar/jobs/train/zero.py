"""ZeRO stage 1 (``--zero 1``): the optimizer state split over the data-parallel replicas.

Each gradient bucket (``grads.GradientReducer``) is cut into dp consecutive pieces, the way
``Communicator.reduce_scatter`` splits it. After the backward:

    reduce-scatter each bucket over dp      -> this rank holds the sum of its piece only
    optimizer step on that piece            -> state for 1/dp of the elements
    all-gather the updated weights over dp  -> every replica holds the whole model again

The parameters' float32 master weights become views into one flat buffer per bucket (as
their gradients already are), so the gather lands in place. The optimizer runs on
*segments*: one ``Param`` per (parameter, piece) overlap, whose data and grad are views, so
the elementwise update and the norm count (``Param.counted``) work unchanged. Checkpoints
stay layout-free: every replica writes its own segments' optimizer state
(``train.checkpoint.write_segments``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...parallel.comm import Communicator, split_sizes
from ...parallel.data_parallel import GradientReducer
from .params import Param


@dataclass
class _Piece:
    grads: object        # the bucket's flat gradients (full, before the reduce-scatter)
    weights: object      # the bucket's flat weights (every param's data is a view)
    lo: int              # this rank's piece: elements [lo, hi) of the bucket
    hi: int
    mine: object         # the reduced gradients of the piece
    sizes: list[int]     # every rank's piece length


class ZeroShards:
    def __init__(self, dp: Communicator, reducer: GradientReducer, xp):
        self.dp, self.xp = dp, xp
        self.pieces: list[_Piece] = []
        self.segments: list[Param] = []
        self.offset: dict[str, int] = {}       # param -> where its segment starts in it
        for flat, params in zip(reducer.buckets, reducer.bucket_params):
            sizes = split_sizes(flat.size, dp.size)
            bounds = [sum(sizes[:r]) for r in range(dp.size + 1)]
            lo, hi = bounds[dp.rank], bounds[dp.rank + 1]
            weights = xp.empty(flat.size, dtype=params[0].master.dtype)
            mine = xp.zeros(hi - lo, dtype=flat.dtype)
            start = 0
            for p in params:
                n = p.master.size
                view = weights[start:start + n].reshape(p.master.shape)
                view[...] = p.master
                if p.data is p.master:
                    p.data = view
                p.master = view
                a, b = max(start, lo), min(start + n, hi)
                if a < b:
                    self.offset[p.name] = a - start
                    self.segments.append(Param(p.spec, weights[a:b], mine[a - lo:b - lo],
                                               p.counted, p.decay, p.kv_replicated))
                start += n
            self.pieces.append(_Piece(flat, weights, lo, hi, mine, sizes))

    def reduce_scatter(self) -> None:
        """Each bucket's gradients summed over dp; this rank keeps its piece."""
        for piece in self.pieces:
            self.dp.reduce_scatter(piece.grads, out=piece.mine)

    def all_gather(self) -> None:
        """Every rank's updated piece of the weights, into every rank's flat buffers."""
        for piece in self.pieces:
            mine = piece.weights[piece.lo:piece.hi].copy()     # MPI may not alias in and out
            self.dp.all_gather(mine, sizes=piece.sizes, out=piece.weights)

    def slice_state(self, full: dict[str, dict]) -> dict[str, dict]:
        """Whole per-param optimizer state (as a checkpoint holds it) cut to this rank's
        segments."""
        out = {}
        for seg in self.segments:
            a = self.offset[seg.name]
            out[seg.name] = {k: v.reshape(-1)[a:a + seg.master.size].copy()
                             for k, v in full[seg.name].items()}
        return out
