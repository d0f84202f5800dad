"""ZeRO stage 1 (``--zero 1``): the optimizer state split over the data-parallel replicas.

Each gradient bucket (``grads.GradientReducer``) is cut into dp consecutive pieces, the way
``Communicator.reduce_scatter`` splits it. After the backward:

    reduce-scatter each bucket over dp      -> this rank holds the sum of its piece only
    optimizer step on that piece            -> state for 1/dp of the elements
    all-gather the updated weights over dp  -> every replica holds the whole model again

The parameters' float32 master weights become views into one flat buffer laid out as their
gradients' (``parallel.data_parallel.flat_buffers``), so a bucket's weights are a span of it and the
gather lands in place. The optimizer runs on *segments*: one ``Param`` per (parameter, piece)
overlap, whose weights and gradients are views of two buffers of this rank's pieces end to end (its
reduced gradients, and its float32 weights: the only copy the optimizer updates, gathered
from as it is), so the update is one run over them, whatever the number of tensors, and
the norm count (``Param.counted``) works unchanged. The pieces' weights cost 4 bytes per
parameter over dp, as Megatron's distributed optimizer's float32 shard does. Checkpoints
stay layout-free: every replica writes its own segments' optimizer state
(``train.checkpoint.my_regions``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...parallel.comm import Communicator, split_sizes
from ...parallel.data_parallel.reducer import GradientReducer
from ...parallel.data_parallel.flat_buffers import Flat, adopt, home
from .params import Param


@dataclass
class _Piece:
    grads: object        # the bucket's flat gradients (full, before the reduce-scatter)
    weights: object      # the bucket's flat weights (every param's master is a view)
    mine: object         # the reduced gradients of this rank's piece
    mine_weights: object  # this rank's piece of the weights (the segments' masters)
    sizes: list[int]     # every rank's piece length


class ZeroShards:
    def __init__(self, dp: Communicator, reducer: GradientReducer, xp):
        self.dp, self.xp = dp, xp
        self.pieces: list[_Piece] = []
        self.segments: list[Param] = []
        self.offset: dict[str, int] = {}       # param -> where its segment starts in it
        by_buffer: dict[int, list[int]] = {}   # each gradient buffer's buckets, in order
        for b, params in enumerate(reducer.bucket_params):
            by_buffer.setdefault(id(home(params[0], "grad")[0]), []).append(b)
        for buckets in by_buffer.values():
            self._shard(reducer, buckets)

    def _shard(self, reducer: GradientReducer, buckets: list[int]) -> None:
        """The pieces and segments of the buckets of one gradient buffer."""
        dp, xp = self.dp, self.xp
        params = [p for b in buckets for p in reducer.bucket_params[b]]
        weights = adopt(xp, params, "master")              # laid out as the gradients
        cuts = []               # per bucket: where it starts, this rank's piece, its overlaps
        for b in buckets:
            start = weights.offsets[home(reducer.bucket_params[b][0], "master")[1]]
            sizes = split_sizes(reducer.buckets[b].size, dp.size)
            lo = start + sum(sizes[:dp.rank])
            hi = lo + sizes[dp.rank]
            cuts.append((b, start, lo, hi, sizes,
                         _overlaps(reducer.bucket_params[b], weights, lo, hi)))
        shapes = [(c - a,) for *_, found in cuts for _, a, c in found]
        mine = Flat(xp, shapes, reducer.buckets[buckets[0]].dtype)
        mine_weights = Flat(xp, shapes, weights.buffer.dtype, zero=False)
        segments: list[Param] = []
        for b, start, lo, hi, sizes, found in cuts:
            first, bucket = len(segments), reducer.buckets[b]
            for p, a, c in found:
                self.offset[p.name] = a - weights.offsets[home(p, "master")[1]]
                i = len(segments)
                segments.append(Param(p.spec, mine_weights.views[i], mine.views[i],
                                      p.counted, p.decay, p.kv_replicated))
            piece = _Piece(bucket, weights.buffer[start:start + bucket.size],
                           mine.span(first, len(segments)),
                           mine_weights.span(first, len(segments)), sizes)
            piece.mine_weights[...] = weights.buffer[lo:hi]
            self.pieces.append(piece)
        mine.place(segments, "grad")
        mine_weights.place(segments, "master")
        self.segments += segments

    def reduce_scatter(self) -> None:
        """Each bucket's gradients summed over dp; this rank keeps its piece."""
        for piece in self.pieces:
            self.dp.reduce_scatter(piece.grads, out=piece.mine)

    def all_gather(self) -> None:
        """Every rank's updated piece of the weights, into every rank's flat buffers (from
        the pieces' own buffer: nothing to copy, MPI may not alias in and out)."""
        for piece in self.pieces:
            self.dp.all_gather(piece.mine_weights, sizes=piece.sizes, out=piece.weights)

    def slice_state(self, full: dict[str, dict]) -> dict[str, dict]:
        """Whole per-param optimizer state (as a checkpoint holds it) cut to this rank's
        segments."""
        out = {}
        for seg in self.segments:
            a = self.offset[seg.name]
            out[seg.name] = {k: v.reshape(-1)[a:a + seg.master.size].copy()
                             for k, v in full[seg.name].items()}
        return out


def _overlaps(params: list[Param], weights: Flat, lo: int, hi: int) -> list[tuple]:
    """(param, a, c): elements [a, c) of the weights' buffer, where each of ``params`` meets
    the piece [lo, hi)."""
    out = []
    for p in params:
        i = home(p, "master")[1]
        a, c = max(weights.offsets[i], lo), min(weights.offsets[i + 1], hi)
        if a < c:
            out.append((p, a, c))
    return out
