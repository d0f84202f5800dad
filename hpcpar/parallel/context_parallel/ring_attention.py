"""Context parallelism: every sequence split over the ranks of a ``cp`` group, attention as
ring attention (Liu et al., 2023; Megatron-Core's and torchtitan's context parallelism).

The split, balanced for causal attention: a sequence of L positions is cut into 2n chunks,
and rank r of n holds chunks r and 2n-1-r, so every rank holds one early and one late piece
and does about the same attention work. The chunks are L // 2n long; of the L % 2n left
over, the early chunks take one each from rank 0 on, then the late ones from rank 0 on, so
that no rank holds two positions more than another. 11 positions over cp 2 (3, 3, 2, 3):

    position  0 1 2 | 3 4 5 | 6 7 | 8 9 10
    rank      0 0 0 | 1 1 1 | 1 1 | 0 0 0         rank 0 holds 0-2 and 8-10, rank 1 3-7

Each rank embeds, projects, normalizes and scores only its own positions; attention alone
needs the others' keys and values. ``RingAttention`` passes the K/V blocks around the group,
each step's non-blocking send and receive overlapping that step's tiles, and merges the
partial outputs by their log-sum-exp (``ops.tiled_attention.merge``); pairs of segments with
no visible key (a key chunk after every query of a query chunk, or in packed rows before
every query's document: ``AttentionRows.documents``, whole rows on every rank) are skipped. The backward
sends K/V around the ring the other way, each block travelling with the dK/dV summed so far,
which reaches the block's owner after a last hop. The weights' gradients of a cp group are
partial (each rank saw some tokens): they are summed over cp with those of dp.

Generation keeps the KV cache split the same way: a prefill leaves each rank the keys of
its own positions (a prefix of its cache slots: its positions increase), and each decoded
token's key goes to one rank, position p to rank p mod n (``SplitKV`` keeps the books). A
decode step runs the new token of every row on every rank of the group; attention reads the
rank's own slots (``SplitCache``) and the partial outputs are merged over the group by their
log-sum-exp (one all-gather of out and lse per layer), the same merge on every rank.

Any attention written over ``AttentionRows`` gets the ring by swapping the op: the rows'
``context`` says which positions this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..device.dtypes import accumulator
from ..errors import HpcparError
from ..ops.attention import AttentionRows, at_positions, check_layouts, score_scale
from ..ops.tiled_attention import TiledAttention, grouped_heads, merge

if TYPE_CHECKING:       # the split is pure (``plan`` reads it without MPI); the ring is not
    from ..comm import Communicator

_KV, _DKV = 11, 12              # message tags of the ring's K/V blocks and their gradients


@dataclass(frozen=True)
class Segment:
    """Positions [at, at + length) of the sequence, at [local, local + length) on the rank."""

    local: int
    length: int
    at: int

    @property
    def span(self) -> slice:
        return slice(self.local, self.local + self.length)

    @property
    def last(self) -> int:
        return self.at + self.length - 1


@dataclass(frozen=True)
class ContextShard:
    """Rank ``rank`` of ``size``'s part of a sequence of ``length`` positions."""

    length: int
    size: int
    rank: int

    @classmethod
    def of(cls, length: int, cp: "Communicator | None") -> "ContextShard | None":
        """This rank's part of rows ``length`` wide, padded to one position per rank of the
        group when shorter; None without a cp group."""
        return None if cp is None else cls(max(length, cp.size), cp.size, cp.rank)

    def __post_init__(self):
        if self.length < self.size:
            raise HpcparError(f"a sequence of {self.length} positions cannot be split over cp "
                              f"{self.size}: every rank needs at least one; use a smaller cp")

    def chunks(self) -> list[tuple[int, int]]:
        """The 2 size chunks [start, stop) of the sequence, in order."""
        n = self.size
        base, extra = divmod(self.length, 2 * n)
        sizes = [base] * (2 * n)
        for r in range(min(extra, n)):
            sizes[r] += 1
        for r in range(extra - n):
            sizes[2 * n - 1 - r] += 1
        starts = np.cumsum([0] + sizes)
        return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]

    def segments(self, rank: int | None = None) -> list[Segment]:
        """The non-empty segments ``rank`` (default: this one) holds, in local order."""
        r = self.rank if rank is None else rank
        chunks = self.chunks()
        out, local = [], 0
        for start, stop in (chunks[r], chunks[2 * self.size - 1 - r]):
            if stop > start:
                out.append(Segment(local, stop - start, start))
                local += stop - start
        return out

    def local_length(self, rank: int | None = None) -> int:
        return sum(s.length for s in self.segments(rank))

    @property
    def max_local(self) -> int:
        """The most positions any rank holds (the ring's block size)."""
        return max(self.local_length(r) for r in range(self.size))

    @property
    def positions(self) -> np.ndarray:
        """The sequence positions this rank holds, in local order (int64)."""
        return np.concatenate([np.arange(s.at, s.at + s.length) for s in self.segments()])

    def take(self, a, axis: int = 1):
        """This rank's columns of ``a`` (whole sequences along ``axis``)."""
        parts = [np.take(a, range(s.at, s.at + s.length), axis=axis) for s in self.segments()]
        return np.concatenate(parts, axis=axis)

    def rows(self, xp, lengths) -> AttentionRows:
        """The attention rows of whole sequences of ``lengths`` (B,) tokens (each at most
        ``length``, the rest padding) as this rank holds them: what ``RingAttention`` takes."""
        rows = AttentionRows.build(xp, lengths, lengths, from_start=True)
        return replace(rows, context=self, max_kv=self.local_length())

    def held(self, lengths) -> np.ndarray:
        """(B,) how many of this rank's positions fall inside each row of ``lengths``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return sum(np.clip(lengths - s.at, 0, s.length) for s in self.segments())

    # ---- what ``AttentionRows`` asks of its context ------------------------------------------

    def query_positions(self, xp, rows: AttentionRows, T: int):
        return rows.starts().astype(xp.int64)[:, None] + xp.asarray(self.positions)[None, :]

    def cache_slots(self, rows: AttentionRows):
        return rows.starts()                       # from slot 0: the positions in local order


@dataclass(frozen=True)
class SplitCache:
    """The context of one decode step over a KV cache split over the cp group: each row's
    new token sits at ``positions`` (B,) of its sequence and its key goes to cache slot
    ``slots`` (B,) of this rank (counted in the rows' kv_lengths on the rank that keeps it
    only; the slot is past the others' lengths, never read there)."""

    positions: object
    slots: object

    def query_positions(self, xp, rows: AttentionRows, T: int):
        return self.positions.astype(xp.int64)[:, None] + xp.arange(T)[None, :]

    def cache_slots(self, rows: AttentionRows):
        return self.slots


class SplitKV:
    """The books of one micro-batch's KV cache split over cp: how many slots of each row this
    rank fills (``held``), from its prefill's positions and then every decoded position p
    with p mod size == rank. The same rule on every rank and stage: nothing is exchanged."""

    def __init__(self, rows: int, size: int, rank: int, capacity: int):
        self.held = np.zeros(rows, dtype=np.int64)
        self.size, self.rank, self.capacity = size, rank, capacity

    @staticmethod
    def local_capacity(positions: int, size: int) -> int:
        """Cache slots a rank needs for rows of up to ``positions`` tokens (prompt and new
        ones): at most ceil(prompt / n) + ceil(new / n) + 1 of them fall to one rank."""
        return -(-max(positions, size) // size) + 2

    def prefilled(self, shard: ContextShard, lengths, slots=None) -> None:
        """Rows ``slots`` (default: all) were prefilled with ``lengths`` tokens."""
        held = shard.held(lengths)
        if slots is None:
            self.held[:] = held
        else:
            self.held[np.asarray(slots)] = held

    def decode_rows(self, xp, positions, going=None) -> AttentionRows:
        """The rows of a decode step whose new tokens sit at ``positions`` (B,) host ints;
        ``going``: the rows whose token counts (default all; a finished row is still fed)."""
        positions = np.asarray(positions, dtype=np.int64)
        mine = self._mine(positions, going)
        slots = np.minimum(self.held, self.capacity - 1)
        rows = AttentionRows.build(xp, np.ones(len(positions), np.int64), slots + mine,
                                   from_start=False)
        return replace(rows, context=SplitCache(xp.asarray(positions),
                                                xp.asarray(slots.astype(np.int32))))

    def decoded(self, positions, going=None) -> None:
        """The step at ``positions`` ran: this rank keeps the keys of its own positions."""
        mine = self._mine(np.asarray(positions, dtype=np.int64), going)
        self.held = np.minimum(self.held + mine, self.capacity - 1)

    def _mine(self, positions: np.ndarray, going) -> np.ndarray:
        mine = (positions % self.size == self.rank).astype(np.int64)
        return mine if going is None else mine * np.asarray(going, dtype=np.int64)


def _visible(q: Segment, k: Segment, rows: AttentionRows) -> bool:
    """Whether any query of segment q may see a key of segment k (rows from position 0)."""
    if k.at > q.last:                                  # keys after every query: causal
        return False
    if k.at == 0:                                      # padding queries see key 0
        return True
    if rows.documents is not None and k.last < rows.documents.earliest(q.at):
        return False                                   # keys before every query's document
    return rows.window is None or k.last > q.at - rows.window


def _pairs(shard: ContextShard, owner: int, rows: AttentionRows):
    """(query segment, key segment) of this rank's queries and ``owner``'s keys that may
    see each other."""
    for qseg in shard.segments():
        for kseg in shard.segments(owner):
            if _visible(qseg, kseg, rows):
                yield qseg, kseg


class RingAttention:
    """The attention op (``forward``, ``forward_train``, ``backward``) over sequences split
    over the cp group ``cp`` (see the module's text); ``local`` computes each block pair's
    tiles. Takes rows with a ``context`` shard, every row from position 0 (whole sequences:
    training, scoring, prefill).

    ``RingAttention(cp)``: the tiles of ``TiledAttention`` on the group's array module;
    ``RingAttention(local, cp)``: those of ``local`` (``TiledAttention(xp, block=64)``)."""

    def __init__(self, local, cp: "Communicator | None" = None):
        if cp is None:
            local, cp = None, local
        if not hasattr(cp, "mpi_comm"):
            raise HpcparError(f"RingAttention(cp) or RingAttention(attention, cp) takes the cp "
                              f"group (mesh.group('cp')), not {type(cp).__name__}")
        local = local if local is not None else TiledAttention(cp.xp)
        self.local, self.cp, self.xp = local, cp, local.xp

    def forward(self, q, keys, values, rows: AttentionRows):
        if isinstance(rows.context, SplitCache):
            return self._decode(q, keys, values, rows)
        return self.forward_train(q, keys, values, rows)[0]

    def _decode(self, q, keys, values, rows: AttentionRows):
        """A decode step: this rank's cached keys, the partial outputs merged over cp."""
        xp = self.xp
        B, T, nh, hd = q.shape
        qs, keys, values = grouped_heads(q, keys, values, rows)
        out, lse = self.local.attend(qs, keys, values, rows, partial=True)
        mine = xp.concatenate([out, lse[..., None]], axis=-1)          # (B, kv, g, T, d + 1)
        every = self.cp.all_gather(xp.ascontiguousarray(mine[None]), axis=0)
        out, lse = every[0, ..., :hd].copy(), every[0, ..., hd].copy()
        for part in every[1:]:                   # in rank order: the same sums on every rank
            merge(xp, out, lse, part[..., :hd], part[..., hd])
        return out.astype(q.dtype, copy=False).transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)

    def forward_train(self, q, keys, values, rows: AttentionRows):
        """(out (B, T, heads, d), ctx) for this rank's T queries against every rank's keys."""
        try:                  # a rank's own bad input, raised on every rank of the group
            shard, error = _shard(rows, self.cp), None
            check_layouts(q, keys, values, rows)
        except HpcparError as e:
            error = e
        self.cp.agree("RingAttention", [
            ("rows, heads and head size of q", (q.shape[0],) + tuple(q.shape[2:])),
            ("kv heads of keys", keys.shape[1]), ("dtype", str(q.dtype)),
            ("the sequence's length", getattr(rows.context, "length", None))], error)
        xp = self.xp
        B, T, nh, hd = q.shape
        qs, keys, values = grouped_heads(q, keys, values, rows)
        keys, values = keys[:, :, :T], values[:, :, :T]          # this rank's (a cache: more)
        acc = accumulator(xp, q.dtype)
        out = xp.zeros(qs.shape, dtype=acc)
        lse = xp.full(qs.shape[:-1], -xp.inf, dtype=acc)
        for owner, kv in self._pass_around(_pack(xp, keys, values, shard.max_local), +1):
            for qseg, kseg in _pairs(shard, owner, rows):
                part, part_lse = self.local.attend(
                    qs[:, :, :, qseg.span], kv[0][:, :, kseg.span], kv[1][:, :, kseg.span],
                    rows, qseg.at, kseg.at)
                merge(xp, out[:, :, :, qseg.span], lse[:, :, :, qseg.span], part, part_lse)
        result = out.astype(q.dtype, copy=False).transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)
        return result, (qs, keys, values, out, lse, rows)

    def _pass_around(self, block, direction: int):
        """Yield (owner, block) for every rank's block in turn, starting with this rank's,
        each received from the neighbour behind while the previous one is in use."""
        cp, xp = self.cp, self.xp
        n, r = cp.size, cp.rank
        spare = xp.empty_like(block)
        for step in range(n):
            pending = []
            if step < n - 1:
                pending = [cp.irecv(spare, (r - direction) % n, _KV),
                           cp.isend(block, (r + direction) % n, _KV)]
            yield (r - direction * step) % n, block
            for request in pending:
                request.wait()
            block, spare = spare, block

    def backward(self, dout, ctx):
        """(dq (B, T, heads, d), dk, dv (B, kv_heads, T, d)) of this rank's positions: K/V go
        round the ring the other way, each with its dK/dV so far, which end at the owner."""
        xp, cp = self.xp, self.cp
        qs, keys, values, out, lse, rows = ctx
        shard = _shard(rows, cp)
        B, T, nh, hd = dout.shape
        nkv, g = qs.shape[1], qs.shape[2]
        dtype, acc = keys.dtype, out.dtype
        do = dout.reshape(B, T, nkv, g, hd).transpose(0, 2, 3, 1, 4)          # (B, kv, g, T, d)
        D = (do.astype(acc, copy=False) * out).sum(axis=-1)
        dq = xp.zeros(qs.shape, dtype=acc)
        n, r = cp.size, cp.rank
        sends = []
        incoming = None                          # the dK/dV so far of the block now held
        packed = _pack(xp, keys, values, shard.max_local)
        for step, (owner, kv) in enumerate(self._pass_around(packed, -1)):
            grads = xp.zeros((2,) + kv.shape[1:], dtype=acc)                  # dk, dv
            for qseg, kseg in _pairs(shard, owner, rows):
                dq_part, dk_part, dv_part = self.local.attend_backward(
                    do[:, :, :, qseg.span], qs[:, :, :, qseg.span], kv[0][:, :, kseg.span],
                    kv[1][:, :, kseg.span], lse[:, :, :, qseg.span], D[:, :, :, qseg.span],
                    rows, qseg.at, kseg.at)
                dq[:, :, :, qseg.span] += dq_part
                grads[0][:, :, kseg.span] += dk_part
                grads[1][:, :, kseg.span] += dv_part
            if incoming is not None:
                incoming[1].wait()
                grads += incoming[0]
            sends.append(cp.isend(grads, (r - 1) % n, _DKV))
            buffer = xp.empty_like(grads)
            incoming = (buffer, cp.irecv(buffer, (r + 1) % n, _DKV))
        incoming[1].wait()                       # this rank's own block, every rank's part in
        for request in sends:
            request.wait()
        mine = incoming[0][:, :, :, :T].astype(dtype, copy=False)
        dq = (dq * score_scale(rows, hd)).astype(dtype, copy=False)
        return dq.transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd), mine[0], mine[1]


def _shard(rows: AttentionRows, cp: "Communicator") -> ContextShard:
    shard = getattr(rows, "context", None)
    if not isinstance(shard, ContextShard) or shard.size != cp.size or shard.rank != cp.rank:
        raise HpcparError(f"RingAttention over cp {cp.size}: the rows' context must be this "
                          f"rank's ContextShard (shard.rows(xp, lengths), with shard = "
                          f"ContextShard(length, cp.size, cp.rank)); got {shard}")
    if not rows.from_start:            # (a shard's rows are: ``ContextShard.rows``)
        raise HpcparError("RingAttention takes whole sequences (rows from position 0)")
    return shard


def _pack(xp, keys, values, width: int):
    """(2, B, kv, width, d) contiguous: this rank's keys and values, zero past its length."""
    B, nkv, T, hd = keys.shape
    block = xp.zeros((2, B, nkv, width, hd), dtype=keys.dtype)
    block[0, :, :, :T] = keys
    block[1, :, :, :T] = values
    return block


def split_batch(xp, ids: np.ndarray, lengths, cp: "Communicator | None"):
    """(ids, rows, shard) of whole rows (B, L) from position 0: under context parallelism
    this rank's positions of them (rows shorter than the group padded to it) and rows that
    say so; without (``cp`` None), the rows as they are and shard None."""
    shard = ContextShard.of(ids.shape[1], cp)
    if shard is None:
        return ids, AttentionRows.build(xp, lengths, lengths, from_start=True), None
    ids = shard.take(np.pad(ids, ((0, 0), (0, shard.length - ids.shape[1]))))
    return ids, shard.rows(xp, lengths), shard


def last_states(xp, y, lengths, shard: ContextShard | None, cp: "Communicator | None"):
    """(B, 1, hidden) each row's states at its last position (lengths - 1) from y (B, T,
    hidden): under context parallelism the rank holding that position gives them, summed
    over the group (the others add zeros), so every rank of the group has every row's."""
    at = np.asarray(lengths, dtype=np.int64) - 1
    if shard is None:
        return at_positions(xp, y, at)
    local = np.searchsorted(shard.positions, at)
    local = np.minimum(local, len(shard.positions) - 1)
    mine = np.flatnonzero(shard.positions[local] == at)
    out = xp.zeros((len(at), 1, y.shape[-1]), dtype=y.dtype)
    if len(mine):
        out[xp.asarray(mine), 0] = y[xp.asarray(mine), xp.asarray(local[mine])]
    return cp.all_reduce(out)
