"""Tiled attention (``ops/tiled_attention.py``) against the full-matrix reference
(``ops/attention.py``): forward and backward, in blocks small enough that every shape has
edges, over prefill with per-row lengths, decode over a KV cache, chunks that start mid-row,
sliding windows and GQA/MQA, in float32, float16 and bfloat16."""

import zlib

import numpy as np
import pytest

from hpcpar.parallel.device.dtypes import bfloat16
from hpcpar.parallel.ops import AttentionRows
from hpcpar.parallel.ops.attention import Attention
from hpcpar.parallel.ops.tiled_attention import TiledAttention

TOL = {np.float32: 2e-6, np.float16: 2e-3, bfloat16: 2e-2}


def _case(rng, B, T, S, nh, nkv, hd, q_len, kv_len, dtype, window=None):
    q = rng.standard_normal((B, T, nh, hd)).astype(dtype)
    k = rng.standard_normal((B, nkv, S, hd)).astype(dtype)
    v = rng.standard_normal((B, nkv, S, hd)).astype(dtype)
    rows = AttentionRows.build(np, q_len, kv_len, from_start=list(q_len) == list(kv_len))
    if window is not None:
        from dataclasses import replace
        rows = replace(rows, window=window)
    dout = rng.standard_normal((B, T, nh, hd)).astype(dtype)
    return q, k, v, rows, dout


CASES = {
    # name: (B, T, S, heads, kv heads, head dim, q lengths, kv lengths, window)
    "prefill, padded rows": (3, 13, 13, 4, 2, 8, [13, 7, 1], [13, 7, 1], None),
    "decode over a cache": (3, 1, 17, 4, 1, 8, [1, 1, 1], [17, 9, 3], None),
    "a chunk mid-row": (2, 6, 19, 4, 4, 8, [6, 4], [19, 11], None),
    "prefill, window 5": (2, 13, 13, 4, 2, 8, [13, 9], [13, 9], 5),
    "decode, window 4": (2, 1, 17, 2, 1, 8, [1, 1], [17, 6], 4),
    "chunk, window 3": (2, 7, 15, 4, 2, 8, [7, 5], [15, 12], 3),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16], ids=str)
@pytest.mark.parametrize("block", [4, 5, 128])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tiles_give_the_reference_output_and_gradients(name, block, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{name} {block}".encode()))
    B, T, S, nh, nkv, hd, q_len, kv_len, window = CASES[name]
    q, k, v, rows, dout = _case(rng, B, T, S, nh, nkv, hd, q_len, kv_len, dtype, window)
    ref, tiled = Attention(np), TiledAttention(np, block=block)
    want, wctx = ref.forward_train(q, k, v, rows)
    got, gctx = tiled.forward_train(q, k, v, rows)
    tol = TOL[dtype]
    valid = np.arange(T)[None, :] < np.asarray(q_len)[:, None]              # (B, T)
    scale = np.abs(want.astype(np.float32)).max()
    np.testing.assert_allclose(got.astype(np.float32)[valid], want.astype(np.float32)[valid],
                               atol=tol * scale, rtol=0)
    assert np.isfinite(got.astype(np.float32)).all()
    for g, w, what in zip(tiled.backward(dout, gctx), ref.backward(dout, wctx),
                          ("dq", "dk", "dv")):
        g, w = g.astype(np.float32), w.astype(np.float32)
        if what == "dq":
            g, w = g[valid], w[valid]
        np.testing.assert_allclose(g, w, atol=tol * max(np.abs(w).max(), 1.0) * 4, rtol=0,
                                   err_msg=what)


def test_blocks_above_the_diagonal_are_skipped_and_inside_blocks_unmasked():
    """Prefill of one 16-token row in blocks of 4: the query block at rows [4, 8) reads key
    blocks [0, 4) (whole, no mask) and [4, 8) (the diagonal, masked), none beyond."""
    rows = AttentionRows.build(np, [16], [16], from_start=True)
    tiles = TiledAttention(np, block=4)._tiles(rows, 16, 16)
    assert [t[:2] for t in tiles] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert tiles[1][2] == [(0, 4, False), (4, 8, True)]
    assert len(tiles[3][2]) == 4                    # the last query block reads every key
    windowed = AttentionRows(rows.q_lengths, rows.kv_lengths, 16, True, window=3)
    assert [b[:2] for b in TiledAttention(np, block=4)._tiles(windowed, 16, 16)[3][2]] == [
        (8, 12), (12, 16)]                          # keys before position 10 never seen


def _dense_scores(q, k, rows):
    """(B, heads, T, S) scaled scores in float64 with -inf where masked: the reference's."""
    from hpcpar.parallel.ops.attention import attention_mask
    B, T, nh, hd = q.shape
    g = nh // k.shape[1]
    scores = np.einsum("bthd,bhsd->bhts", q.astype(np.float64),
                       np.repeat(k.astype(np.float64), g, axis=1)) / np.sqrt(hd)
    mask = attention_mask(np, rows, T, k.shape[2])[:, 0]          # (B, 1, T, S)
    return np.where(mask, scores, -np.inf)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_starting_shift_is_a_score_each_query_reaches(name):
    """The known shift's premise: each query's starting c is one of its visible scores, so
    at most its largest (padding queries included: they see key 0 alone)."""
    from hpcpar.parallel.ops.softmax_shift import reached_scores
    from hpcpar.parallel.ops.tiled_attention import grouped_heads
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    B, T, S, nh, nkv, hd, q_len, kv_len, window = CASES[name]
    q, k, v, rows, _ = _case(rng, B, T, S, nh, nkv, hd, q_len, kv_len, np.float64, window)
    qs, keys, _ = grouped_heads(q * 3.0, k, v, rows)
    start = reached_scores(np, qs, keys, rows).reshape(B, nh, T)
    scores = _dense_scores(q * 3.0, k, rows)                       # (B, heads, T, S)
    visible = np.isclose(scores, start[..., None], rtol=0, atol=1e-12).any(axis=-1)
    assert visible.all()
    assert (start <= scores.max(axis=-1) + 1e-12).all()


def test_spans_of_large_scores_move_the_shift_and_keep_the_reference_output():
    """A key of large norm (scores of ~100): the spans the bound cannot keep in range take
    their maximum, the others do not, and the output equals the reference in float32 and
    float64, its lse too."""
    from hpcpar.parallel.ops.softmax_shift import KnownShift, spans
    from hpcpar.parallel.ops.tiled_attention import grouped_heads
    rng = np.random.default_rng(7)
    B, T, nh, nkv, hd = 2, 24, 4, 2, 8
    for dtype in (np.float32, np.float64):
        q, k, v, rows, _ = _case(rng, B, T, T, nh, nkv, hd, [24, 19], [24, 19], dtype)
        k[0, :, 5] *= 60.0                     # row 0's key 5: scores of ~100 in span [0, 8)
        qs, keys, values = grouped_heads(q, k, v, rows)
        known = KnownShift.build(np, qs, keys, values, rows, 4, 0, 0, False)
        tile = TiledAttention(np, block=4)._tiles(rows, T, T)[3]
        joined = spans(tile[2], 8)
        assert [s[:2] for s in joined] == [(0, 8), (8, 12), (12, 16)]
        assert known.may_overflow(12, 16, joined) == [True, False, False]
        assert known.may_overflow(0, 4, spans(TiledAttention(np, block=4)._tiles(
            rows, T, T)[0][2], 8)) == [False]
        ref = Attention(np)
        want = ref.forward(q, k, v, rows)
        tiled = TiledAttention(np, block=4)
        got, ctx = tiled.forward_train(q, k, v, rows)
        valid = np.arange(T)[None, :] < np.array([24, 19])[:, None]
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[valid], want[valid], rtol=0,
                                   atol=(2e-6 if dtype == np.float32 else 1e-13) * scale)
        lse = ctx[4].reshape(B, nh, T)                            # (B, kv, g, T) -> heads
        scores = _dense_scores(q, k, rows)
        top = scores.max(axis=-1)
        want_lse = top + np.log(np.exp(scores - top[..., None]).sum(axis=-1))
        np.testing.assert_allclose(lse.transpose(0, 2, 1)[valid],
                                   want_lse.transpose(0, 2, 1)[valid], rtol=0,
                                   atol=(2e-6 if dtype == np.float32 else 1e-13)
                                   * np.abs(want_lse).max())


def test_the_known_shift_is_for_whole_sequences_in_float32_and_float64():
    """Decode steps (fewer queries than a block), 16-bit inputs and segments of a ring keep
    the online softmax."""
    from hpcpar.parallel.ops.softmax_shift import KnownShift
    from hpcpar.parallel.ops.tiled_attention import grouped_heads
    rng = np.random.default_rng(3)
    q, k, v, rows, _ = _case(rng, 1, 8, 8, 2, 1, 4, [8], [8], np.float32)
    build = KnownShift.build
    assert build(np, *grouped_heads(q, k, v, rows), rows, 4, 0, 0, False) is not None
    assert build(np, *grouped_heads(q, k, v, rows), rows, 16, 0, 0, False) is None
    assert build(np, *grouped_heads(q, k, v, rows), rows, 4, 4, 0, False) is None
    assert build(np, *grouped_heads(q, k, v, rows), rows, 4, 0, 0, True) is None
    half = [a.astype(np.float16) for a in (q, k, v)]
    assert build(np, *grouped_heads(*half, rows), rows, 4, 0, 0, False) is None


def test_a_query_of_norm_zero_bounds_its_keys_without_overflow():
    """A padded row's queries are zeros (the prefill pads with them): their key limit is
    large and finite, with no overflow warning (a user saw one: a limit divided by float's
    tiny), and the output is the reference's on the real rows."""
    import warnings
    from hpcpar.parallel.ops.softmax_shift import KnownShift
    from hpcpar.parallel.ops.tiled_attention import grouped_heads
    rng = np.random.default_rng(11)
    q, k, v, rows, _ = _case(rng, 2, 12, 12, 4, 2, 8, [12, 5], [12, 5], np.float32)
    q[1, 5:] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        known = KnownShift.build(np, *grouped_heads(q, k, v, rows), rows, 4, 0, 0, False)
        got = TiledAttention(np, block=4).forward(q, k, v, rows)
    assert np.isfinite(known.key_limit).all()
    want = Attention(np).forward(q, k, v, rows)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_allclose(got[1, :5], want[1, :5], rtol=0, atol=2e-6 * np.abs(want).max())
