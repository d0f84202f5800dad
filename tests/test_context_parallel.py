"""Context parallelism's core (``hpcpar.parallel.context_parallel.ring_attention``): the
load-balanced split of a sequence, the log-sum-exp merge of partial attentions, and ring attention
over the whole world (mpiexec -n 2 and 8) against the full-matrix reference attention of the whole
sequence, forward and dq/dk/dv, on sequences longer than one tile and not divisible by the cp size,
with padded rows, GQA, sliding windows, in float32 and bfloat16."""

import os
import zlib
from dataclasses import replace

import numpy as np
import pytest

from hpcpar.parallel.device.backend import select_backend
from hpcpar.parallel.device.dtypes import bfloat16
from hpcpar.parallel.errors import HpcparError
from hpcpar.parallel.ops import AttentionRows
from hpcpar.parallel.ops.attention import Attention
from hpcpar.parallel.ops.tiled_attention import TiledAttention, merge
from hpcpar.parallel.context_parallel.ring_attention import ContextShard, RingAttention

TOL = {np.float32: 2e-6, bfloat16: 2e-2}


def test_the_split_covers_each_position_once_and_balances_causal_work():
    for length, size in [(11, 2), (37, 4), (8, 8), (9, 8), (100, 3), (5, 2), (4099, 8),
                         (32768, 4), (2049, 2)]:
        shards = [ContextShard(length, size, r) for r in range(size)]
        held = np.concatenate([s.positions for s in shards])
        assert sorted(held.tolist()) == list(range(length)), (length, size)
        counts = [len(s.positions) for s in shards]
        assert max(counts) - min(counts) <= 1, (length, size, counts)
        # causal work of a rank: the keys its queries see; mirrored chunks even it out
        work = [int((s.positions + 1).sum()) for s in shards]
        if length >= 100 * size:
            assert max(work) / min(work) < 1.01, (length, size, work)
        ids = np.arange(3 * length).reshape(3, length)
        for s in shards:
            assert (s.take(ids) == ids[:, s.positions]).all()
    assert ContextShard(11, 2, 0).positions.tolist() == [0, 1, 2, 8, 9, 10]
    assert ContextShard(11, 2, 1).positions.tolist() == [3, 4, 5, 6, 7]


def test_a_sequence_shorter_than_cp_is_one_clear_error():
    with pytest.raises(HpcparError, match="3 positions cannot be split over cp 4"):
        ContextShard(3, 4, 0)


def test_merging_partials_over_key_sets_is_attention_over_their_union():
    """Queries 10..19 of a 20-token row attend keys [0, 7) and [7, 20) apart, merged, and
    equal the whole attention (and its lse)."""
    rng = np.random.default_rng(0)
    B, T, nh, nkv, hd = 2, 20, 4, 2, 8
    q = rng.standard_normal((B, T, nh, hd)).astype(np.float32)
    k = rng.standard_normal((B, nkv, T, hd)).astype(np.float32)
    v = rng.standard_normal((B, nkv, T, hd)).astype(np.float32)
    rows = AttentionRows.build(np, [T, 14], [T, 14], from_start=True)
    tiled = TiledAttention(np, block=4)
    want, (qs, _, _, _, want_lse, _) = tiled.forward_train(q, k, v, rows)
    qs = qs[:, :, :, 10:]
    out, lse = tiled.attend(qs, k[:, :, :7], v[:, :, :7], rows, q_at=10, k_at=0)
    part, part_lse = tiled.attend(qs, k[:, :, 7:], v[:, :, 7:], rows, q_at=10, k_at=7)
    merge(np, out, lse, part, part_lse)
    got = out.transpose(0, 3, 1, 2, 4).reshape(B, 10, nh, hd)
    np.testing.assert_allclose(got, want[:, 10:], atol=1e-6)
    np.testing.assert_allclose(lse, want_lse[:, :, :, 10:], atol=1e-5)


CASES = {
    # name: (rows, length, heads, kv heads, row lengths, window)
    "gqa, padded rows": (3, 37, 4, 2, [37, 23, 2], None),
    "mqa": (2, 29, 4, 1, [29, 29], None),
    "window 6, padded": (2, 31, 4, 2, [31, 17], 6),
}


@pytest.mark.device
@pytest.mark.mpi(ranks=(2, 8))             # a ring of two, and of eight
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_ring_attention_gives_the_whole_sequences_attention_and_gradients(comm, name, dtype):
    import hpcpar.parallel as hp
    backend = select_backend(os.environ.get("HPCPAR_BACKEND", "numpy"))
    xp = backend.xp
    mesh = hp.Mesh(comm, {"cp": comm.Get_size()}, backend=backend, timeout=60)
    cp = mesh.group("cp")
    B, T, nh, nkv, lengths, window = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))     # the same on every rank
    q = rng.standard_normal((B, T, nh, 8)).astype(dtype)
    k = rng.standard_normal((B, T, nkv, 8)).astype(dtype)
    v = rng.standard_normal((B, T, nkv, 8)).astype(dtype)
    dout = rng.standard_normal((B, T, nh, 8)).astype(dtype)
    rows = replace(AttentionRows.build(np, lengths, lengths, from_start=True), window=window)
    ref = Attention(np)
    want, wctx = ref.forward_train(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), rows)
    wdq, wdk, wdv = ref.backward(dout, wctx)

    shard = ContextShard(T, cp.size, cp.rank)
    mine = shard.positions
    local_rows = replace(AttentionRows.build(xp, lengths, lengths, from_start=True),
                         window=window, context=shard)
    ring = RingAttention(TiledAttention(xp, block=4), cp)       # several tiles per chunk
    put = backend.asarray
    got, ctx = ring.forward_train(put(q[:, mine]), put(k[:, mine]).transpose(0, 2, 1, 3),
                                  put(v[:, mine]).transpose(0, 2, 1, 3), local_rows)
    dq, dk, dv = (backend.to_host(a) for a in ring.backward(put(dout[:, mine]), ctx))
    got = backend.to_host(got)

    tol = TOL[dtype]
    real = mine[None, :] < np.asarray(lengths)[:, None]                  # (B, local)

    def close(a, b, what, scale_floor=0.0):
        a, b = a.astype(np.float32), b.astype(np.float32)
        np.testing.assert_allclose(a, b, atol=tol * 4 * max(np.abs(b).max(), scale_floor),
                                   rtol=0, err_msg=f"{what} on cp rank {cp.rank}")

    close(got[real], want[:, mine][real], "output")
    close(dq[real], wdq[:, mine][real], "dq", 1.0)
    close(dk, wdk[:, :, mine], "dk", 1.0)
    close(dv, wdv[:, :, mine], "dv", 1.0)
    mesh.free()


def test_the_context_parallel_package_names_what_a_ring_takes():
    import hpcpar.parallel as hp
    from hpcpar.parallel import context_parallel
    assert context_parallel.TiledAttention is TiledAttention
    assert context_parallel.AttentionRows is AttentionRows
    assert {"TiledAttention", "AttentionRows"} <= set(hp.context_parallel.__all__)


@pytest.mark.mpi(ranks=(2, 4))
def test_a_ring_without_its_attention_runs_the_tiles_of_its_groups_arrays(comm):
    """``RingAttention(cp)`` is ``RingAttention(TiledAttention(cp.xp), cp)``; rows that are
    not a shard's are one error on every rank of the group, and the mesh goes on."""
    import hpcpar.parallel as hp
    mesh = hp.Mesh(comm, {"cp": -1}, timeout=60)
    cp = mesh.group("cp")
    B, T, nh, nkv, hd, lengths = 2, 300, 4, 2, 8, [300, 170]    # more than one 128 tile
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, T, nh, hd))
    k, v = (rng.standard_normal((B, nkv, T, hd)) for _ in range(2))
    shard = ContextShard(T, cp.size, cp.rank)
    args = (shard.take(q, axis=1), shard.take(k, axis=2), shard.take(v, axis=2))
    ring = hp.RingAttention(cp)
    assert isinstance(ring.local, TiledAttention) and ring.local.xp is np
    got, _ = ring.forward_train(*args, shard.rows(np, lengths))
    want, _ = hp.RingAttention(TiledAttention(np, block=16), cp).forward_train(
        *args, shard.rows(np, lengths))
    real = shard.positions[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(got[real], want[real], atol=1e-12)
    whole = AttentionRows.build(np, lengths, lengths, from_start=True)   # not this rank's
    with pytest.raises(HpcparError, match="the rows' context must be this rank's"):
        ring.forward_train(*args, whole)
    with pytest.raises(HpcparError, match="the layouts are q"):
        ring.forward_train(args[0], args[1].transpose(0, 2, 1, 3), args[2], shard.rows(
            np, lengths))
    assert mesh.errors.alarm() is None
    mesh.free()


# ---- the axis's bad input: one line from one rank, exit 2, no output ---------------------

BAD_CP = {
    # name: (ranks, command and flags, rows of the data file, what the line says)
    "sequence shorter than cp": (4, ["train", "--cp", "4", "--global-batch", "2",
                                     "--out", "run"], (4, 4), "sequences have 3 positions"),
    "cp not dividing the world": (4, ["train", "--cp", "3", "--global-batch", "2",
                                      "--out", "run"], (4, 20), "cp 3 does not divide the "
                                                                "world of 4 ranks"),
    "rows shorter than cp": (4, ["score", "--cp", "4", "--out", "s.h5"], (4, 3),
                             "longest row of data.npy has 3 tokens"),
    "prompt logits under cp": (2, ["generate", "--cp", "2", "--max-new-tokens", "2",
                                   "--prompts", "random", "--save-logits", "--out", "g.h5"],
                               (4, 9), "--save-logits: the prompt logits of a prompt split"),
    "a window under cp": (2, ["generate", "--cp", "2", "--max-new-tokens", "2", "--prompts",
                              "random", "--out", "g.h5"], (4, 9), "sliding window of 5"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_CP))
def test_bad_use_of_the_cp_axis_is_one_clear_error(tmp_path, name):
    from helpers import TINY, make_checkpoint, mpirun
    from helpers import MISTRAL
    ranks, command, shape, message = BAD_CP[name]
    make_checkpoint(tmp_path, MISTRAL if "window" in name else TINY)
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 250, shape))
    data = ["--data", "data.npy"] if command[0] != "generate" else []
    proc, _ = mpirun(ranks, ["-m", "hpcpar", command[0], "--checkpoint", "model.h5", *data,
                             *command[1:]], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("*.h5.*"))
    assert not (tmp_path / "s.h5").exists() and not (tmp_path / "g.h5").exists()


@pytest.mark.device
@pytest.mark.mpi(ranks=(2, 8))             # a ring of two, and of eight
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=str)
def test_a_decode_step_over_a_cache_split_over_cp_is_the_whole_caches_attention(comm, dtype):
    """Rows of 37, 20 and 1 prompt tokens, then decode steps: each rank's cache holds its
    prefill positions and every decoded position p with p mod cp == its rank (``SplitKV``);
    the merged attention of each step's query equals the reference over the whole cache."""
    import hpcpar.parallel as hp
    from hpcpar.parallel.context_parallel.ring_attention import SplitKV
    backend = select_backend(os.environ.get("HPCPAR_BACKEND", "numpy"))
    xp, put = backend.xp, backend.asarray
    mesh = hp.Mesh(comm, {"cp": comm.Get_size()}, backend=backend, timeout=60)
    cp = mesh.group("cp")
    lengths, steps, nh, nkv, hd = np.array([37, 20, 1]), 5, 4, 2, 8
    B, S = len(lengths), 37 + steps
    rng = np.random.default_rng(11)
    k = rng.standard_normal((B, nkv, S, hd)).astype(dtype)
    v = rng.standard_normal((B, nkv, S, hd)).astype(dtype)
    q = rng.standard_normal((steps, B, 1, nh, hd)).astype(dtype)
    shard = ContextShard(37, cp.size, cp.rank)
    split = SplitKV(B, cp.size, cp.rank, SplitKV.local_capacity(S, cp.size))
    split.prefilled(shard, lengths)
    ring = RingAttention(TiledAttention(xp, block=4), cp)
    for step in range(steps):
        at = lengths + step                                    # each row's new token
        rows = split.decode_rows(xp, at)
        held = []                                              # positions in local slots
        for b in range(B):
            mine = [p for p in shard.positions if p < lengths[b]]
            mine += [p for p in range(lengths[b], at[b] + 1) if p % cp.size == cp.rank]
            held.append(mine)
        cache_k = np.zeros((B, nkv, split.capacity, hd), dtype)
        cache_v = np.zeros_like(cache_k)
        for b, mine in enumerate(held):
            cache_k[b, :, :len(mine)], cache_v[b, :, :len(mine)] = k[b][:, mine], v[b][:, mine]
            assert len(mine) == int(backend.to_host(rows.kv_lengths)[b]), (step, b)
        got = backend.to_host(ring.forward(put(q[step]), put(cache_k), put(cache_v), rows))
        split.decoded(at)
        whole = AttentionRows.build(np, np.ones(B, np.int64), at + 1, from_start=False)
        want = Attention(np).forward(q[step], k, v, whole)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   atol=TOL[dtype] * 4 * np.abs(want.astype(np.float32)).max(),
                                   rtol=0, err_msg=f"step {step}, cp rank {cp.rank}")
    mesh.free()
