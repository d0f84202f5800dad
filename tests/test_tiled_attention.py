"""Tiled attention (``ops/tiled_attention.py``) against the full-matrix reference
(``ops/attention.py``): forward and backward, in blocks small enough that every shape has
edges, over prefill with per-row lengths, decode over a KV cache, chunks that start mid-row,
sliding windows and GQA/MQA, in float32, float16 and bfloat16."""

import zlib

import numpy as np
import pytest

from hpcpar.dtypes import bfloat16
from hpcpar.ops import AttentionRows
from hpcpar.ops.attention import Attention
from hpcpar.ops.tiled_attention import TiledAttention

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
