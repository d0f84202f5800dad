"""Each op of ``hpcpar.parallel.ops`` (the NumPy references every backend starts from) against an
independent float64 reference written here with torch, forward and backward (torch autograd),
in float32, float16 and bfloat16, at odd sizes: GQA groups, a tp shard's head counts, T = 1,
padding queries, an empty row.

Inputs are rounded to the dtype first and the reference runs on the rounded values in float64,
so the error measured is the op's own. Bounds are normwise, a few unit roundoffs of the dtype
(u = 6e-8, 4.9e-4, 3.9e-3) times the handful of rounded steps each op takes: float32 1e-5,
float16 4e-3, bfloat16 3e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcpar.parallel.device.dtypes import float_dtype
from hpcpar.parallel.ops import AttentionRows, embedding_lookup, linear, linear_input_grad, native_ops

OPS = native_ops(np)
DTYPES = ["float32", "float16", "bfloat16"]
NORMWISE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


def rounded(rng, shape, dtype, scale=1.0):
    """(array in ``dtype``, the same values as a float64 torch tensor)."""
    a = (rng.standard_normal(shape) * scale).astype(np.float32).astype(float_dtype(dtype))
    return a, torch.from_numpy(a.astype(np.float64))


def assert_close(got, ref, dtype, where=None):
    got = np.asarray(got).astype(np.float64)
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, np.float64)
    if where is not None:
        got, ref = got[where], ref[where]
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)
    assert err <= NORMWISE[dtype], f"normwise error {err:.2e} > {NORMWISE[dtype]} ({dtype})"


def leaf(t):
    return t.clone().requires_grad_(True)


# ---- linear --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_its_input_gradient(dtype):
    rng = np.random.default_rng(0)
    x, xt = rounded(rng, (3, 5, 37), dtype)
    w_t, wt = rounded(rng, (37, 19), dtype, 0.2)
    dy, dyt = rounded(rng, (3, 5, 19), dtype)
    assert_close(linear(x, w_t), xt @ wt, dtype)
    assert_close(linear_input_grad(dy, w_t), dyt @ wt.T, dtype)


# ---- RMSNorm -------------------------------------------------------------------------------

def torch_rms_norm(x, w, eps):
    return w * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [3, 7, 96])
def test_rms_norm_its_fused_add_and_backward(dtype, width):
    rng = np.random.default_rng(width)
    x, xt = rounded(rng, (2, 3, width), dtype)
    res, rt = rounded(rng, (2, 3, width), dtype)
    w, wt = rounded(rng, (width,), dtype, 0.3)
    dy, dyt = rounded(rng, (2, 3, width), dtype)
    eps = 1e-5
    assert_close(OPS.rms_norm.forward(x, w, eps), torch_rms_norm(xt, wt, eps), dtype)
    y, s = OPS.rms_norm.add_forward(x, res, w, eps)
    assert_close(s, xt + rt, dtype)
    assert_close(y, torch_rms_norm(torch.from_numpy(s.astype(np.float64)), wt, eps), dtype)
    _, ctx = OPS.rms_norm.forward_train(x, w, eps)
    dx, dw = OPS.rms_norm.backward(dy, ctx, w)
    xl, wl = leaf(xt), leaf(wt)
    torch_rms_norm(xl, wl, eps).backward(dyt)
    assert dx.dtype == x.dtype
    assert_close(dx, xl.grad, dtype)
    assert_close(dw, wl.grad, dtype)


# ---- rotary --------------------------------------------------------------------------------

def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_q_and_k_and_its_backward(dtype):
    rng = np.random.default_rng(1)
    B, T, nh, nkv, d = 2, 5, 6, 3, 10                   # GQA group 2, head_dim not a power of 2
    qkv, _ = rounded(rng, (B, T, (nh + 2 * nkv) * d), dtype)
    q = qkv[..., :nh * d].reshape(B, T, nh, d)           # views, as the qkv GEMM leaves them
    k = qkv[..., nh * d:(nh + nkv) * d].reshape(B, T, nkv, d)
    angles = rng.uniform(0, 6.3, (B, T, 1, d // 2))
    cos = np.concatenate([np.cos(angles)] * 2, -1).astype(float_dtype(dtype))
    sin = np.concatenate([np.sin(angles)] * 2, -1).astype(float_dtype(dtype))
    c, s = (torch.from_numpy(a.astype(np.float64)) for a in (cos, sin))
    qt, kt = (torch.from_numpy(a.astype(np.float64)) for a in (q, k))
    rq, rk = OPS.rotary.forward(q, k, cos, sin)
    assert_close(rq, torch_rope(qt, c, s), dtype)
    assert_close(rk, torch_rope(kt, c, s), dtype)
    dq, dqt = rounded(rng, q.shape, dtype)
    dk, dkt = rounded(rng, k.shape, dtype)
    ql, kl = leaf(qt), leaf(kt)
    (torch_rope(ql, c, s) * dqt).sum().add((torch_rope(kl, c, s) * dkt).sum()).backward()
    gq, gk = OPS.rotary.backward(dq, dk, cos, sin)
    assert_close(gq, ql.grad, dtype)
    assert_close(gk, kl.grad, dtype)


# ---- SwiGLU --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_and_its_backward(dtype):
    rng = np.random.default_rng(2)
    gate, gt = rounded(rng, (3, 4, 45), dtype, 3.0)     # far into both tails of the sigmoid
    up, ut = rounded(rng, (3, 4, 45), dtype)
    da, dat = rounded(rng, (3, 4, 45), dtype)
    gl, ul = leaf(gt), leaf(ut)
    ref = torch.nn.functional.silu(gl) * ul
    ref.backward(dat)
    assert_close(OPS.swiglu.forward(gate, up), ref, dtype)
    dg, du = OPS.swiglu.backward(da, gate, up)
    assert_close(dg, gl.grad, dtype)
    assert_close(du, ul.grad, dtype)


# ---- attention -----------------------------------------------------------------------------

def torch_attention(q, keys, values, q_lengths, kv_lengths):
    """float64 softmax attention, row by row and query by query from the definition: query t
    of row b sits at position kv_len - q_len + t and sees keys [0, position]."""
    B, T, nh, d = q.shape
    g = nh // keys.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for t in range(int(q_lengths[b])):
            visible = int(kv_lengths[b]) - int(q_lengths[b]) + t + 1
            for h in range(nh):
                k, v = keys[b, h // g, :visible], values[b, h // g, :visible]
                p = torch.softmax(k @ q[b, t, h] / d ** 0.5, dim=0)
                out[b, t, h] = p @ v
    return out


def _valid_queries(q_lengths, T):
    return np.arange(T)[None, :] < np.asarray(q_lengths)[:, None]        # (B, T)


CASES = {
    # name: (heads, kv_heads, T, q_lengths, kv_lengths, capacity)
    "prefill, GQA 4, padded rows": (8, 2, 7, [7, 3, 5], [7, 3, 5], 7),
    "prefill, one tp shard's heads (3 of 6, kv 1)": (3, 1, 4, [4, 1], [4, 1], 4),
    "decode T=1 over a cache": (4, 2, 1, [1, 1, 1], [9, 1, 5], 12),
    "chunk of 3 after a cached prefix": (4, 4, 3, [3, 2, 3], [8, 2, 3], 10),
    "an empty row beside full ones": (4, 2, 3, [3, 0, 2], [3, 0, 2], 3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_over_per_row_lengths(dtype, case):
    nh, nkv, T, q_len, kv_len, S = CASES[case]
    rng = np.random.default_rng(len(case))
    B, d = len(q_len), 16
    q, qt = rounded(rng, (B, T, nh, d), dtype)
    keys, kt = rounded(rng, (B, nkv, S, d), dtype)
    values, vt = rounded(rng, (B, nkv, S, d), dtype)
    from_start = q_len == kv_len
    rows = AttentionRows.build(np, q_len, kv_len, from_start)
    out = OPS.attention.forward(q, keys, values, rows)
    assert out.shape == (B, T, nh, d) and np.isfinite(out.astype(np.float32)).all()
    ref = torch_attention(qt, kt, vt, q_len, kv_len)
    assert_close(out, ref, dtype, where=_valid_queries(q_len, T))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["prefill, GQA 4, padded rows",
                                  "prefill, one tp shard's heads (3 of 6, kv 1)",
                                  "an empty row beside full ones"])
def test_attention_backward_as_training_runs_it(dtype, case):
    """Training rows start at position 0 (q = kv lengths); the loss gives padding queries no
    gradient, so dout is zero there."""
    nh, nkv, T, lengths, _, S = CASES[case]
    rng = np.random.default_rng(3)
    B, d = len(lengths), 8
    q, qt = rounded(rng, (B, T, nh, d), dtype)
    keys, kt = rounded(rng, (B, nkv, S, d), dtype)
    values, vt = rounded(rng, (B, nkv, S, d), dtype)
    dout, dot = rounded(rng, (B, T, nh, d), dtype)
    valid = _valid_queries(lengths, T)
    dout[~valid] = 0
    dot[torch.from_numpy(~valid)] = 0
    rows = AttentionRows.build(np, lengths, lengths, True)
    _, ctx = OPS.attention.forward_train(q, keys, values, rows)
    dq, dk, dv = OPS.attention.backward(dout, ctx)
    ql, kl, vl = leaf(qt), leaf(kt), leaf(vt)
    (torch_attention(ql, kl, vl, lengths, lengths) * dot).sum().backward()
    assert_close(dq, ql.grad, dtype, where=valid)
    assert_close(dk, kl.grad, dtype)
    assert_close(dv, vl.grad, dtype)


# ---- KV-cache write, embedding -------------------------------------------------------------

@pytest.mark.parametrize("from_start", [True, False])
def test_kv_write_puts_each_row_at_its_own_slots(from_start):
    rng = np.random.default_rng(4)
    B, T, nkv, d, S = 3, 2, 2, 4, 9
    starts = np.zeros(B, np.int64) if from_start else np.array([0, 5, 3])
    k = rng.standard_normal((B, T, nkv, d)).astype(np.float32)
    v = rng.standard_normal((B, T, nkv, d)).astype(np.float32)
    cache_k, cache_v = np.full((2, B, nkv, S, d), np.nan, np.float32)
    OPS.kv_write.forward(cache_k, cache_v, k, v, starts, from_start)
    for b in range(B):
        for t in range(T):
            np.testing.assert_array_equal(cache_k[b, :, starts[b] + t], k[b, t])
            np.testing.assert_array_equal(cache_v[b, :, starts[b] + t], v[b, t])
    assert np.isfinite(cache_k).sum() == B * T * nkv * d == np.isfinite(cache_v).sum()


def test_embedding_blocks_sum_to_the_whole_table():
    rng = np.random.default_rng(5)
    table = rng.standard_normal((11, 6)).astype(np.float32)
    ids = rng.integers(0, 11, (3, 4))
    parts = []
    for start, stop in ((0, 6), (6, 11)):                 # two tp ranks' vocabulary blocks
        out, local, owned = embedding_lookup(np, table[start:stop], ids, start, stop, True)
        np.testing.assert_array_equal(owned, (ids >= start) & (ids < stop))
        np.testing.assert_array_equal(local[owned], ids[owned] - start)
        parts.append(out)
    np.testing.assert_array_equal(parts[0] + parts[1], table[ids])


# ---- vocab-parallel cross-entropy and sampling reductions ----------------------------------

@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_cross_entropy_pieces_over_vocabulary_blocks(blocks):
    """The pieces of each block, combined as the AllReduces would (max, then sums), give
    torch's weighted cross-entropy and its gradient; the last block carries padding columns."""
    rng = np.random.default_rng(blocks)
    N, V = 7, 23
    z = rng.standard_normal((N, V)) * 4
    labels = rng.integers(0, V, N)
    labels[2] = -1                                        # ignored
    weights = np.where(labels >= 0, 1.0 / (labels >= 0).sum(), 0.0)
    width = -(-V // blocks)
    edges = [(i * width, min((i + 1) * width, V)) for i in range(blocks)]
    pieces = []
    for start, stop in edges:
        block = np.full((N, width), 123.0, np.float32)   # padding columns: garbage
        block[:, :stop - start] = z[:, start:stop]
        pieces.append(block)
    m = np.max([OPS.cross_entropy.local_max(p, stop - start)
                for p, (start, stop) in zip(pieces, edges)], axis=0)
    out = [OPS.cross_entropy.local_sums(p, m, labels, start, stop)
           for p, (start, stop) in zip(pieces, edges)]
    sums = sum(s for s, _ in out)
    loss, _ = OPS.cross_entropy.loss(sums, m, weights.astype(np.float32))
    zt = leaf(torch.from_numpy(z))
    per_row = torch.nn.functional.cross_entropy(zt, torch.from_numpy(labels), ignore_index=-1,
                                                reduction="none")
    ref = (per_row * torch.from_numpy(weights)).sum()
    ref.backward()
    assert abs(float(loss) - ref.item()) <= 1e-5 * abs(ref.item())
    dz = np.concatenate([OPS.cross_entropy.backward(ctx, sums[0], weights.astype(np.float32))
                         [:, :stop - start] for (_, ctx), (start, stop) in zip(out, edges)], -1)
    assert_close(dz, zt.grad, "float32")


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_candidates_merged_as_one_rank_orders_them(k):
    rng = np.random.default_rng(k)
    N, V = 5, 29
    z = rng.integers(-3, 4, (N, V)).astype(np.float32)   # many ties
    values, ids = [], []
    for start, stop in ((0, 10), (10, 20), (20, 29)):
        vals, idx = OPS.top_k.local(z[:, start:stop], k)
        values.append(vals)
        ids.append(idx + start)
    vals, ids = OPS.top_k.merge(np.concatenate(values, -1), np.concatenate(ids, -1))
    order = np.lexsort((np.arange(V)[None, :].repeat(N, 0), -z), axis=-1)[:, :k]
    np.testing.assert_array_equal(ids[:, :k], order)
    np.testing.assert_array_equal(vals[:, :k], np.take_along_axis(z, order, -1))
