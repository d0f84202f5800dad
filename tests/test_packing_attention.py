"""Attention over packed rows (``AttentionRows.documents``): the tiled attention and ring
attention against a dense NumPy reference written here with a block-diagonal causal mask
(each query sees the keys of its own document up to itself; padding queries key 0 alone),
forward and backward, in tiles small enough that documents start mid-tile; fully masked
tiles are skipped; rotary positions restart at each document."""

import os
import zlib
from dataclasses import replace

import numpy as np
import pytest

from hpcpar.parallel.ops.attention import AttentionRows, Documents
from hpcpar.parallel.ops.tiled_attention import TiledAttention

# (rows' documents' lengths, padding after them), T = 23 positions
ROWS = [[5, 9, 1, 8], [23], [3, 3, 3, 7]]
T = 23
LENGTHS = [sum(r) for r in ROWS]               # 23, 23, 16: the last row padded


def _dense_mask():
    """(B, T, T) which keys each query sees: its document's, up to itself."""
    mask = np.zeros((len(ROWS), T, T), bool)
    for b, docs in enumerate(ROWS):
        at = 0
        for n in docs:
            for t in range(at, at + n):
                mask[b, t, at:t + 1] = True
            at += n
        mask[b, at:, 0] = True                      # padding: key 0 alone
    return mask


def _dense(q, k, v, dout):
    """(out, dq, dk, dv) in float64 by the mask written out: q (B, T, h, d), k, v (B, T, kv,
    d); backward through the softmax by its Jacobian, no library code."""
    B, T_, nh, hd = q.shape
    g = nh // k.shape[2]
    mask = _dense_mask()
    kk = np.repeat(k.astype(np.float64), g, axis=2)
    vv = np.repeat(v.astype(np.float64), g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q.astype(np.float64), kk) / np.sqrt(hd)
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", p, vv)
    do = dout.astype(np.float64)
    dp = np.einsum("bthd,bshd->bhts", do, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, kk) / np.sqrt(hd)
    dk = np.einsum("bhts,bthd->bshd", ds, q.astype(np.float64)) / np.sqrt(hd)
    dv = np.einsum("bhts,bthd->bshd", p, do)
    fold = lambda a: a.reshape(B, T_, k.shape[2], g, hd).sum(3)      # noqa: E731
    return out, dq, fold(dk), fold(dv)


def _inputs(seed, dtype, nh=4, nkv=2, hd=8):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((3, T, nh, hd)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((3, T, nkv, hd)).astype(dtype) for _ in range(2))
    return q, k, v, dout


def _rows(xp=np):
    rows = AttentionRows.build(xp, LENGTHS, LENGTHS, from_start=True)
    return replace(rows, documents=Documents.of_lengths(xp, ROWS, T))


def _close(got, want, what, tol, real=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if real is not None:
        got, want = got[real], want[real]
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(np.abs(want).max(), 1.0),
                               err_msg=what)


REAL = np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]             # (B, T)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("block", [4, 5, 128])
def test_tiles_over_packed_rows_are_the_block_diagonal_causal_attention(block, dtype):
    q, k, v, dout = _inputs(zlib.crc32(f"{block}".encode()), dtype)
    want = _dense(q, k, v, dout)
    op = TiledAttention(np, block=block)
    out, ctx = op.forward_train(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), _rows())
    dq, dk, dv = op.backward(dout, ctx)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    _close(out, want[0], "out", tol, REAL)
    _close(dq, want[1], "dq", 4 * tol, REAL)
    _close(dk.transpose(0, 2, 1, 3), want[2], "dk", 4 * tol)
    _close(dv.transpose(0, 2, 1, 3), want[3], "dv", 4 * tol)


def test_the_known_shift_starts_each_query_at_a_score_it_sees():
    """The tiles' starting shift (``softmax_shift.reached_scores``) is a score of a key in
    the query's own document (its first key's, or its own), so at most its largest."""
    from hpcpar.parallel.ops.softmax_shift import reached_scores
    from hpcpar.parallel.ops.tiled_attention import grouped_heads
    q, k, v, _ = _inputs(3, np.float64)
    q[:, :, :, :] *= 3.0
    k[:, 5] *= 8.0                        # key 5 (a document's first in row 0) far larger
    rows = _rows()
    qs, keys, _ = grouped_heads(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), rows)
    start = reached_scores(np, qs, keys, rows).reshape(3, 4, T)       # (B, heads, T)
    g = q.shape[2] // k.shape[2]
    scores = np.einsum("bthd,bshd->bhts", q, np.repeat(k, g, axis=2)) / np.sqrt(q.shape[3])
    seen = _dense_mask()[:, None]                                     # (B, 1, T, S)
    visible = np.where(seen, scores, -np.inf)
    assert (np.isclose(visible, start[..., None], rtol=0, atol=1e-9).any(-1)).all()
    assert (start <= visible.max(-1) + 1e-9).all()


def test_tiles_before_a_queries_document_are_skipped():
    """Row 1 alone, one document of 23: every key block below the diagonal is read; with
    documents of 5, 9, 1, 8 in blocks of 4, query block [16, 20) (all in the last
    document, from 15) reads key blocks [12, 16) (masked) and [16, 20) only."""
    rows = _rows()
    one = replace(AttentionRows.build(np, [23], [23], True),
                  documents=Documents.of_lengths(np, [[5, 9, 1, 8]], T))
    tiles = TiledAttention(np, block=4)._tiles(one, T, T)
    assert tiles[4][:2] == (16, 20) and tiles[4][2] == [(12, 16, True), (16, 20, True)]
    assert tiles[5][2] == [(12, 16, True), (16, 20, False), (20, 23, True)]
    # every row's documents together: the earliest any row's query there may see
    assert [b[0] for b in TiledAttention(np, block=4)._tiles(rows, T, T)[4][2]][0] == 0


def test_rotary_positions_restart_at_each_document():
    want = np.concatenate([np.arange(n) for n in ROWS[0]])
    assert _rows().positions(np, T)[0].tolist() == want.tolist()
    assert _rows().positions(np, T)[2][:16].tolist() == [0, 1, 2] * 3 + list(range(7))


def test_packed_rows_are_whole_rows_from_position_zero():
    from hpcpar.parallel.errors import HpcparError
    with pytest.raises(HpcparError, match="whole rows from position 0"):
        replace(AttentionRows.build(np, [1], [5], from_start=False),
                documents=Documents.of_lengths(np, [[5]], 5))


@pytest.mark.device
@pytest.mark.mpi(ranks=(2,))
def test_ring_attention_over_packed_rows_is_the_block_diagonal_attention(comm):
    import hpcpar.parallel as hp
    from hpcpar.parallel.context_parallel.ring_attention import ContextShard, RingAttention
    from hpcpar.parallel.device.backend import select_backend
    backend = select_backend(os.environ.get("HPCPAR_BACKEND", "numpy"))
    xp, put = backend.xp, backend.asarray
    mesh = hp.Mesh(comm, {"cp": comm.Get_size()}, backend=backend, timeout=60)
    cp = mesh.group("cp")
    q, k, v, dout = _inputs(11, np.float64)
    want = _dense(q, k, v, dout)
    shard = ContextShard(T, cp.size, cp.rank)
    mine = shard.positions
    rows = replace(AttentionRows.build(xp, LENGTHS, LENGTHS, from_start=True), context=shard,
                   max_kv=shard.local_length(), documents=Documents.of_lengths(xp, ROWS, T))
    ring = RingAttention(TiledAttention(xp, block=4), cp)
    out, ctx = ring.forward_train(put(q[:, mine]), put(k[:, mine]).transpose(0, 2, 1, 3),
                                  put(v[:, mine]).transpose(0, 2, 1, 3), rows)
    dq, dk, dv = (backend.to_host(a) for a in ring.backward(put(dout[:, mine]), ctx))
    real = REAL[:, mine]
    _close(backend.to_host(out), want[0][:, mine], "out", 1e-12, real)
    _close(dq, want[1][:, mine], "dq", 1e-12, real)
    _close(dk.transpose(0, 2, 1, 3), want[2][:, mine], "dk", 1e-12)
    _close(dv.transpose(0, 2, 1, 3), want[3][:, mine], "dv", 1e-12)
    mesh.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cudnn_ragged_attention_over_packed_rows_is_the_block_diagonal_attention(
        monkeypatch, dtype):
    """cuDNN's ragged form (off until it has run: turned on here) against the dense
    reference, forward and backward; its keys and values strided views of one (B, T, 2, kv,
    d) array, as training passes them. Normwise 1e-2 (bfloat16) and 2e-3 (float16), as
    tests/test_ops_gpu.py holds cuDNN's other graphs."""
    import cupy
    from hpcpar.parallel.ops.cuda.attention import CudnnAttention
    op = CudnnAttention(cupy)
    monkeypatch.setattr(op, "ragged", True)
    q, k, v, dout = _inputs(5, np.float32, nh=8, nkv=2, hd=64)
    dout = np.where(REAL[:, :, None, None], dout, 0.0)          # padding outputs unused
    q, kv, dout = (cupy.asarray(a).astype(dtype) for a in (q, np.stack([k, v], 2), dout))
    rounded = [cupy.asnumpy(a.astype(cupy.float32)) for a in (q, kv, dout)]
    want = _dense(rounded[0], rounded[1][:, :, 0], rounded[1][:, :, 1], rounded[2])
    keys, values = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)
    out, ctx = op.forward_train(q, keys, values, _rows(cupy))
    assert type(ctx).__name__ == "RaggedContext"                  # the ragged graph ran
    grads = op.backward(dout, ctx)
    tol = {"float16": 2e-3, "bfloat16": 1e-2}[dtype]

    def normwise(got, ref, what, real=None):
        got = cupy.asnumpy(got.astype(cupy.float32)).astype(np.float64)
        if real is not None:
            got, ref = got[real], ref[real]
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert np.isfinite(got).all() and err <= tol, f"{what}: normwise {err:.2e}"

    normwise(out, want[0], "out", REAL)
    normwise(grads[0], want[1], "dq", REAL)
    normwise(grads[1].transpose(0, 2, 1, 3), want[2], "dk")
    normwise(grads[2].transpose(0, 2, 1, 3), want[3], "dv")
