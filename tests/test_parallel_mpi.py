"""The parallel core against dense NumPy references: redistribution between placements, every
sharded-matmul and feed-forward policy (forward and backward), the parallel layers and f/g,
the pipeline over user stage functions under every schedule, the data-parallel reduction,
and bad input as one error on every rank. On 2 ranks and on 8 (a 1-D mesh of each, and
8's 2-D and 3-D meshes; pipelines of 2 and 8 stages).

Tolerances, relative to the largest element of the reference (computed in float64 from the
same rounded inputs): float64 1e-12, float32 1e-5, float16 2e-3, bfloat16 1.6e-2 (a 16-bit
product is accumulated in float32 and rounded once; a 16-bit sum over ranks adds in float32
and rounds at each step). Redistribution only moves data: it is exact in every dtype.
"""

import itertools
import os
import re

import numpy as np
import pytest

import hpcpar.parallel as hp
from hpcpar.parallel.comm.agreement import Disagreement
from hpcpar.parallel.device.backend import select_backend
from hpcpar.parallel.device.dtypes import bfloat16
from hpcpar.parallel.tensor import even_sizes, matmul_communication
from hpcpar.parallel.tensor_parallel import GatherFromGroup, ScatterToGroup

pytestmark = [pytest.mark.mpi(ranks=(2, 8)), pytest.mark.device]

S0, S1, R, P = hp.Shard(0), hp.Shard(1), hp.Replicate(), hp.Partial()
TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5,
             np.dtype(np.float16): 2e-3, bfloat16: 1.6e-2}
FLOATS = [np.float64, np.float32, np.float16, bfloat16]


def backend():
    """The array backend the suite runs on (HPCPAR_BACKEND=strict: the pretend device)."""
    return select_backend(os.environ.get("HPCPAR_BACKEND", "numpy"))


def meshes(comm):
    """A 1-D mesh, a 2-D one (4+ ranks) and a 3-D one (8 ranks) over the world."""
    n = comm.Get_size()
    out = [hp.Mesh(comm, {"x": n}, backend=backend(), timeout=60)]
    if n >= 4 and n % 2 == 0:
        out.append(hp.Mesh(comm, {"x": 2, "y": n // 2}, backend=backend(), timeout=60))
    if n == 8:
        out.append(hp.Mesh(comm, {"x": 2, "y": 2, "z": 2}, backend=backend(), timeout=60))
    return out


def host(mesh, a):
    return mesh.backend.to_host(a) if mesh.backend.on_device else np.asarray(a)


def options(p: int, shape):
    """What one mesh axis of p ranks can hold of an array of ``shape``: uneven sizes and
    whole units (replicated when there are fewer units than ranks) included."""
    rows, cols = shape
    out = [R, P, hp.Shard(0, sizes=even_sizes(rows, p)),
           hp.Shard(1, sizes=even_sizes(cols, p)), hp.Shard(1, unit=cols // 2)]
    if rows % p == 0:
        out.append(S0)
    return out


def layouts(mesh, shape, limit, seed):
    """Placement lists for ``mesh`` that split ``shape`` (all on 1-D, a seeded sample else)."""
    full = [list(c) for c in itertools.product(*(options(p, shape) for p in mesh.sizes))]
    ok = []
    for c in full:
        try:
            hp.DArray.from_full(np.zeros(shape), mesh, c)
            ok.append(c)
        except hp.tensor.ShardingError:
            pass
    rng = np.random.default_rng(seed)          # the same sample on every rank
    if len(ok) > limit:
        ok = [ok[i] for i in sorted(rng.choice(len(ok), limit, replace=False))]
    return ok


def test_redistribution_between_placements_is_exact(comm):
    shape = (7, 10)
    for mesh in meshes(comm):
        for dtype in FLOATS + [np.int64]:
            full = (np.arange(70).reshape(shape) % 23 - 11).astype(dtype)
            cases = layouts(mesh, shape, 12 if dtype != np.float32 else 40, seed=len(mesh.sizes))
            for src, dst in itertools.product(cases, repeat=2):
                x = hp.DArray.from_full(full, mesh, src)
                y = x.redistribute(dst)
                assert y.placements == tuple(dst)
                assert y.local.shape == y.local_shape_at(mesh.coords)
                got = host(mesh, y.full())
                assert got.dtype == full.dtype
                np.testing.assert_array_equal(got, full, err_msg=f"{src} -> {dst}")


def test_from_local_infers_the_global_shape_and_uneven_sizes(comm):
    mesh = hp.Mesh(comm, {"x": comm.Get_size()}, backend=backend(), timeout=60)
    rank, n = mesh.rank, comm.Get_size()
    rows = rank + 1                                   # uneven by construction
    local = mesh.backend.xp.asarray(np.full((rows, 3), rank, dtype=np.float32))
    x = hp.DArray.from_local(local, mesh, [S0])
    assert x.shape == (n * (n + 1) // 2, 3)
    assert x.placements[0].sizes == tuple(range(1, n + 1))
    expected = np.concatenate([np.full((r + 1, 3), r, np.float32) for r in range(n)])
    np.testing.assert_array_equal(host(mesh, x.full()), expected)
    # pieces that are not one array are refused on every rank
    bad = mesh.backend.xp.asarray(np.zeros((2, 3 + (rank == n - 1)), np.float32))
    with pytest.raises(hp.tensor.PlacementError, match="not its piece"):
        hp.DArray.from_local(bad, mesh, [S0])


def _rounded(a, dtype):
    return a.astype(dtype).astype(np.float64)


def _check(mesh, got, ref, dtype, what):
    got = host(mesh, got).astype(np.float64)
    scale = max(1.0, np.abs(ref).max())
    err = np.abs(got - ref).max() / scale
    assert err <= TOLERANCE[np.dtype(dtype)], f"{what}: {err:.2e} in {np.dtype(dtype)}"


def policy_cases(mesh, k):
    """(policy, A placements, B placements, axis) with uneven and unit-wise cuts of k."""
    n = mesh.sizes[0]
    ks = even_sizes(k, n)
    cases = [("duplicated", {}, {}, None),
             ("inner", {"x": hp.Shard(1, sizes=ks)}, {"x": hp.Shard(0, sizes=ks)}, "x"),
             ("inner", {"x": hp.Shard(1, sizes=ks)}, {}, "x"),     # B sliced like A
             ("inner_gather", {"x": hp.Shard(1, sizes=ks)},
              {"x": hp.Shard(1, sizes=even_sizes(4, n))}, "x"),    # B by columns
             ("inner_gather", {"x": hp.Shard(1, sizes=ks)},
              {"x": hp.Shard(0, sizes=[k] + [0] * (n - 1))}, "x"),     # other cuts of k
             # 2 whole units ("heads") of k: one per rank, or each replicated when 4+ ranks,
             # which a pending sum would count twice: gathered instead
             ("inner" if n == 2 else "inner_gather", {"x": hp.Shard(1, unit=k // 2)},
              {"x": hp.Shard(0, unit=k // 2)}, "x"),
             ("outer", {"x": hp.Shard(0, sizes=even_sizes(6, n))},
              {"x": hp.Shard(0, sizes=ks)}, "x"),
             ("local", {"x": hp.Shard(0, sizes=even_sizes(6, n))}, {}, None)]
    if len(mesh.sizes) >= 2:
        cases.append(("full", {"x": S0, "y": hp.Shard(1, sizes=even_sizes(k, mesh.sizes[1]))},
                      {"x": hp.Shard(0, sizes=even_sizes(k, mesh.sizes[0])),
                       "y": hp.Shard(1, sizes=even_sizes(4, mesh.sizes[1]))}, ("x", "y")))
    return cases


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_matmul_policy_forward_and_backward(comm, dtype):
    rng = np.random.default_rng(1)
    k = 10
    a_full, b_full = rng.standard_normal((6, k)), rng.standard_normal((k, 4))
    dy_full = rng.standard_normal((6, 4))
    a_ref, b_ref, dy_ref = (_rounded(v, dtype) for v in (a_full, b_full, dy_full))
    for mesh in meshes(comm)[:2]:
        for name, pa, pb, axis in policy_cases(mesh, k):
            a = hp.DArray.from_full(a_full.astype(dtype), mesh, pa)
            b = hp.DArray.from_full(b_full.astype(dtype), mesh, pb)
            y, ctx = hp.tensor.matmul_forward(a, b)
            assert ctx.policy == name, (ctx.policy, name, pa, pb)
            _check(mesh, y.full(), a_ref @ b_ref, dtype, f"{name} forward")
            da, db = hp.tensor.matmul_backward(hp.DArray.from_full(dy_full.astype(dtype), mesh,
                                                            y.placements), ctx)
            assert da.placements == a.placements and db.placements == b.placements
            _check(mesh, da.full(), dy_ref @ b_ref.T, dtype, f"{name} dA")
            _check(mesh, db.full(), a_ref.T @ dy_ref, dtype, f"{name} dB")
            # the same policy asked for by name, from replicated operands
            y2 = hp.matmul(hp.DArray.from_full(a_full.astype(dtype), mesh, {}),
                           hp.DArray.from_full(b_full.astype(dtype), mesh, {}),
                           policy=name, axis=axis)
            _check(mesh, y2.full(), a_ref @ b_ref, dtype, f"{name} by name")


def test_inner_policy_outputs_on_request(comm):
    mesh = hp.Mesh(comm, {"x": comm.Get_size()}, backend=backend(), timeout=60)
    rng = np.random.default_rng(2)
    a_full, b_full = rng.standard_normal((comm.Get_size() * 2, 8)), rng.standard_normal((8, 3))
    a = hp.DArray.from_full(a_full, mesh, [hp.Shard(1, sizes=even_sizes(8, mesh.sizes[0]))])
    b = hp.DArray.from_full(b_full, mesh, [hp.Shard(0, sizes=even_sizes(8, mesh.sizes[0]))])
    assert matmul_communication(a, b) == ["Y: all_reduce over 'x': Partial() -> Replicate()"]
    assert matmul_communication(a, b, out=[S0]) == [
        "Y: reduce_scatter over 'x': Partial() -> Shard(0)"]
    for out in ([S0], [P]):
        y = hp.matmul(a, b, out=out)
        assert y.placements == tuple(out)
        np.testing.assert_allclose(host(mesh, y.full()), a_full @ b_full, rtol=1e-12)


def test_one_placement_alone_places_on_a_one_axis_mesh_and_is_one_error_on_more(comm):
    """``out=Shard(0)`` as the policy table reads: on a mesh of one axis it is that axis'
    placement; on more axes (which one?) and for what is no placement at all, one
    ``PlacementError`` on every rank, not a TypeError."""
    n = comm.Get_size()
    rng = np.random.default_rng(4)
    a_full, b_full = rng.standard_normal((2 * n, 8)), rng.standard_normal((8, 3))
    line = hp.Mesh(comm, {"x": n}, backend=backend(), timeout=60)
    a = hp.DArray.from_full(a_full, line, S1)
    b = hp.DArray.from_full(b_full, line, S0)
    y = hp.matmul(a, b, out=S0)
    assert y.placements == (S0,)
    np.testing.assert_allclose(host(line, y.full()), a_full @ b_full, rtol=1e-12)
    grid = hp.Mesh(comm, {"dp": 1, "tp": n}, backend=backend(), timeout=60)
    a = hp.DArray.from_full(a_full, grid, {"tp": S1})
    b = hp.DArray.from_full(b_full, grid, {"tp": S0})
    for bad, words in [(S0, "one placement, Shard(0), for a mesh of axes ['dp', 'tp']"),
                       (P, "such as {'tp': Partial()}"), (5, "placements 5: give one per")]:
        with pytest.raises(hp.tensor.PlacementError, match=re.escape(words)):
            hp.matmul(a, b, out=bad)
        with pytest.raises(hp.tensor.PlacementError, match=re.escape(words)):
            hp.DArray.from_full(a_full, grid, bad)


@pytest.mark.parametrize("policy", hp.tensor.FFN_POLICIES)
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "silu"])
def test_feed_forward_policies(comm, policy, activation):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"tp": n}, backend=backend(), timeout=60)
    rng = np.random.default_rng(3)
    rows, d, h = 2 * n, 2 * n, 4 * n
    x_full, w1, w2 = (rng.standard_normal(s) for s in ((rows, d), (d, h), (h, d)))
    dy_full = rng.standard_normal((rows, d))
    x_pl, w1_pl, w2_pl = {"megatron": (R, S1, S0), "allgather": (R, S1, S1),
                          "sequence": (S0, S1, S0)}[policy]
    ffn = hp.tensor.FeedForward(hp.DArray.from_full(w1, mesh, [w1_pl]),
                         hp.DArray.from_full(w2, mesh, [w2_pl]), policy, activation=activation)
    y, ctx = ffn.forward(hp.DArray.from_full(x_full, mesh, [x_pl]))
    f, df = hp.tensor.ACTIVATIONS[activation]
    z = x_full @ w1
    np.testing.assert_allclose(host(mesh, y.full()), f(np, z) @ w2, rtol=1e-10, atol=1e-12)
    dx, dw1, dw2 = ffn.backward(hp.DArray.from_full(dy_full, mesh, y.placements), ctx)
    dz = (dy_full @ w2.T) * df(np, z)
    assert dx.placements == (x_pl,) and dw1.placements == (w1_pl,)
    for got, ref in ((dw2, f(np, z).T @ dy_full), (dw1, x_full.T @ dz), (dx, dz @ w1.T)):
        np.testing.assert_allclose(host(mesh, got.full()), ref, rtol=1e-10, atol=1e-12)
    # the activation's derivative against a finite difference of the function
    zs = np.linspace(-3, 3, 12)                       # not 0: relu has no derivative there
    np.testing.assert_allclose(df(np, zs), (f(np, zs + 1e-6) - f(np, zs - 1e-6)) / 2e-6,
                               rtol=1e-5, atol=1e-8)


def test_parallel_layers_from_whole_weights(comm):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"tp": n}, backend=backend(), timeout=60)
    tp, xp = mesh.group("tp"), mesh.backend.xp
    rng = np.random.default_rng(4)
    d, h = 6, 3 * n + 1                                # h uneven: given sizes
    x = rng.standard_normal((2, 3, d)).astype(np.float32)
    w1, b1, w2, b2 = (rng.standard_normal(s).astype(np.float32)
                      for s in ((h, d), (h,), (d, h), (d,)))
    sizes = even_sizes(h, n)
    col = hp.ColumnParallelLinear.from_full(tp, w1, b1, sizes=sizes)
    row = hp.RowParallelLinear.from_full(tp, w2, b2, sizes=sizes)
    xd = xp.asarray(x)
    z, ctx1 = col.forward(xd)
    y, ctx2 = row.forward(z)
    ref_z = x @ w1.T + b1
    np.testing.assert_allclose(host(mesh, y), ref_z @ w2.T + b2, rtol=1e-5, atol=1e-5)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dz = row.backward(xp.asarray(dy), ctx2)
    dx = col.backward(dz, ctx1)
    np.testing.assert_allclose(host(mesh, dx), dy @ w2 @ w1, rtol=1e-4, atol=1e-4)
    dw1 = tp.all_gather(col.weights[0].grad, axis=0, sizes=sizes)
    np.testing.assert_allclose(host(mesh, dw1), (dy @ w2).reshape(-1, h).T @ x.reshape(-1, d),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(host(mesh, row.bias.grad), dy.reshape(-1, d).sum(0), rtol=1e-5)


def test_vocabulary_layers_and_cross_entropy(comm):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"tp": n}, backend=backend(), timeout=60)
    tp, xp = mesh.group("tp"), mesh.backend.xp
    rng = np.random.default_rng(5)
    vocab, d = 4 * n + 3, 5                            # not a multiple of tp: padded
    table = rng.standard_normal((vocab, d)).astype(np.float32)
    ids = rng.integers(0, vocab, (2, 7))
    emb = hp.VocabParallelEmbedding.from_full(tp, table)
    h, ctx = emb.forward(xp.asarray(ids))
    np.testing.assert_array_equal(host(mesh, h), table[ids])
    head = hp.ParallelLMHead.from_full(tp, table)
    logits = head.local_logits(h.reshape(-1, d))
    full = host(mesh, head.full_logits(logits))
    np.testing.assert_allclose(full, table[ids].reshape(-1, d) @ table.T, rtol=1e-5, atol=1e-5)
    labels = rng.integers(0, vocab, ids.size)
    weights = np.full(ids.size, 1.0 / ids.size, np.float32)
    ce = hp.VocabParallelCrossEntropy(None, vocab, tp)
    loss, ce_ctx = ce.forward(logits, xp.asarray(labels), xp.asarray(weights))
    z = full.astype(np.float64)
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert abs(float(loss) - -logp[np.arange(ids.size), labels].mean()) < 1e-5
    dlogits = ce.backward(ce_ctx)
    ref = np.exp(logp)
    ref[np.arange(ids.size), labels] -= 1
    start, stop = head.start, head.stop
    np.testing.assert_allclose(host(mesh, dlogits)[:, :stop - start], ref[:, start:stop] / ids.size,
                               rtol=1e-4, atol=1e-6)


def test_megatron_f_and_g(comm):
    mesh = hp.Mesh(comm, {"tp": comm.Get_size()}, backend=backend(), timeout=60)
    tp, xp, n, r = mesh.group("tp"), mesh.backend.xp, comm.Get_size(), comm.Get_rank()
    x = xp.asarray(np.full((n + 1, 2), r + 1.0))
    assert hp.tensor_parallel.f.forward(x, tp) is x
    total = n * (n + 1) / 2
    np.testing.assert_array_equal(host(mesh, hp.tensor_parallel.f.backward(x.copy(), tp)), total)
    np.testing.assert_array_equal(host(mesh, hp.tensor_parallel.g.forward(x.copy(), tp)), total)
    assert hp.tensor_parallel.g.backward(x, tp) is x
    sizes = even_sizes(n + 1, n)
    mine = ScatterToGroup.forward(x, tp, axis=0, sizes=sizes)
    assert mine.shape == (sizes[r], 2)
    assert ScatterToGroup.backward(mine, tp, axis=0, sizes=sizes).shape == (n + 1, 2)
    gathered = GatherFromGroup.forward(mine, tp, axis=0, sizes=sizes)
    np.testing.assert_array_equal(host(mesh, gathered)[:, 0],
                                  np.repeat(np.arange(1.0, n + 1), sizes))
    back = GatherFromGroup.backward(xp.asarray(np.ones((n + 1, 2))), tp, axis=0, sizes=sizes)
    np.testing.assert_array_equal(host(mesh, back), n)                    # summed, then cut


# ---- the pipeline over user stage functions --------------------------------------------------

D = 4


class TanhLayer:
    """y = tanh(x W^T): a stage (or a chunk) with its weight gradient, split for ZB-H1."""

    def __init__(self, w, xp):
        self.xp, self.w = xp, hp.Parameter(xp.asarray(w))

    def forward(self, x):
        y = self.xp.tanh(x @ self.w.data.T)
        return y, (x, y)

    def backward_input(self, dy, ctx):
        x, y = ctx
        dz = dy * (1 - y * y)
        return dz @ self.w.data, (dz, x)

    def backward_weight(self, wctx):
        dz, x = wctx
        self.w.grad += dz.T @ x

    def backward(self, dy, ctx):
        dx, wctx = self.backward_input(dy, ctx)
        self.backward_weight(wctx)
        return dx


def _loss(y, target):
    diff = y - target
    return float((diff * diff).sum()), 2 * diff


def _dense(weights, inputs, targets):
    """Loss and every layer's gradient of the unpipelined model, in NumPy."""
    grads, total = [np.zeros_like(w) for w in weights], 0.0
    for x, t in zip(inputs, targets):
        acts = [x]
        for w in weights:
            acts.append(np.tanh(acts[-1] @ w.T))
        diff = acts[-1] - t
        total += float((diff * diff).sum())
        dy = 2 * diff
        for i in reversed(range(len(weights))):
            dz = dy * (1 - acts[i + 1] ** 2)
            grads[i] += dz.T @ acts[i]
            dy = dz @ weights[i]
    return total, grads


@pytest.mark.parametrize("schedule,virtual,micro_batches,recompute", [
    ("gpipe", 1, 3, False), ("1f1b", 1, 5, False), ("1f1b", 1, 1, True),
    ("interleaved", 2, None, False), ("zb-h1", 1, 4, False), ("zb-h1", 1, 1, False)])
def test_pipeline_schedules_equal_the_unpipelined_model(comm, schedule, virtual, micro_batches,
                                                        recompute):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"pp": n}, backend=backend(), timeout=60)
    xp, stage = mesh.backend.xp, mesh.rank
    m = micro_batches or 2 * n
    rng = np.random.default_rng(6)
    weights = [rng.standard_normal((D, D)) * 0.5 for _ in range(n * virtual)]
    rows = [2 + (i * 3) % 5 for i in range(m)]       # micro-batches of different shapes
    inputs = [rng.standard_normal((r, D)) for r in rows]
    targets = [rng.standard_normal((r, D)) for r in rows]
    chunks = [TanhLayer(weights[c * n + stage], xp) for c in range(virtual)]
    pipe = hp.Pipeline(mesh.group("pp"), chunks if virtual > 1 else chunks[0],
                       loss=lambda y, t: _loss(y, xp.asarray(t)), schedule=schedule,
                       recompute=recompute)
    losses = pipe.train_step([xp.asarray(x) for x in inputs], targets)
    total, grads = _dense(weights, inputs, targets)
    if pipe.is_last:
        assert len(losses) == m and abs(sum(losses) - total) < 1e-10
    else:
        assert losses == []
    for c, chunk in enumerate(chunks):
        np.testing.assert_allclose(host(mesh, chunk.w.grad), grads[c * n + stage], rtol=1e-10,
                                   atol=1e-12)
    assert 0.0 <= pipe.bubble() < 1.0
    assert pipe.bubble_formula(m) == hp.pipeline.bubble_formula(schedule, n, m, virtual)


def test_pipeline_forward_returns_the_last_stage_outputs(comm):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"pp": n}, backend=backend(), timeout=60)
    xp = mesh.backend.xp
    rng = np.random.default_rng(7)
    weights = [rng.standard_normal((D, D)) for _ in range(n)]
    inputs = [rng.standard_normal((r, D)) for r in (1, 4, 2)]
    pipe = hp.Pipeline(mesh.group("pp"), TanhLayer(weights[mesh.rank], xp))
    outs = pipe.forward([xp.asarray(x) for x in inputs])
    if pipe.is_last:
        for x, y in zip(inputs, outs):
            for w in weights:
                x = np.tanh(x @ w.T)
            np.testing.assert_allclose(host(mesh, y), x, rtol=1e-12)


class WrongStage(TanhLayer):
    def forward(self, x):
        return x                                       # not (y, ctx)


def test_a_stage_that_returns_the_wrong_type_is_an_error_on_every_rank(comm):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"pp": n}, backend=backend(), timeout=30)   # its own communicators
    xp = mesh.backend.xp
    w = np.eye(D)
    bad = n - 1
    stage = WrongStage(w, xp) if mesh.rank == bad else TanhLayer(w, xp)
    pipe = hp.Pipeline(mesh.group("pp"), stage, loss=lambda y, t: _loss(y, y * 0))
    xs = [xp.asarray(np.ones((2, D))) for _ in range(3)]
    with pytest.raises(hp.HpcparError) as raised:
        pipe.train_step(xs, [None] * 3)
    if mesh.rank == bad:
        assert "forward must return a pair (y, ctx) with y an array" in str(raised.value)
    else:
        assert isinstance(raised.value, hp.PeerFailed)
        assert f"rank {bad} failed: pipeline stage {bad}: forward must return" in str(raised.value)


def test_a_schedule_that_cannot_run_is_refused_before_the_first_step(comm):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"pp": n}, backend=backend(), timeout=30)
    xp = mesh.backend.xp
    pipe = hp.Pipeline(mesh.group("pp"), TanhLayer(np.eye(D), xp),
                       loss=lambda y, t: _loss(y, y * 0))
    m = 2 if mesh.rank == 0 else 3                     # the ranks disagree on the count
    with pytest.raises(Disagreement, match="micro-batch count .*: 2 on rank 0 and 3 on "):
        pipe.train_step([xp.asarray(np.ones((1, D)))] * m, [None] * m)
    chunks = [TanhLayer(np.eye(D), xp), TanhLayer(np.eye(D), xp)]
    interleaved = hp.Pipeline(mesh.group("pp"), chunks, schedule="interleaved", loss=_loss)
    with pytest.raises(hp.HpcparError, match=f"micro_batches {n + 1} is not a multiple of pp"):
        interleaved.train_step([None] * (n + 1), [None] * (n + 1))


def test_bad_shapes_and_operands_are_one_error_on_every_rank(comm):
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"x": n}, backend=backend(), timeout=30)
    other = hp.Mesh(comm, {"x": n}, backend=backend(), timeout=30)
    with pytest.raises(hp.tensor.ShardingError, match=f"length {n + 1} does not split evenly over "
                                               f"{n} ranks; pass sizes="):
        hp.DArray.from_full(np.zeros((n + 1, 2)), mesh, [S0])
    a = hp.DArray.from_full(np.ones((2 * n, 2 * n)), mesh, [S0])
    with pytest.raises(hp.tensor.PolicyError, match="different meshes"):
        hp.matmul(a, hp.DArray.from_full(np.ones((2 * n, 3)), other, [R]))
    with pytest.raises(hp.tensor.PolicyError, match="fit none of the policies"):
        hp.matmul(a, hp.DArray.from_full(np.ones((2 * n, 2 * n)), mesh, [S1]))
    with pytest.raises(hp.mesh.MeshError, match=rf"x\({n}\) \* y\(2\) = {2 * n} != world size {n}"):
        hp.Mesh(comm, {"x": n, "y": 2})


def test_gradient_buckets_sum_over_replicas_and_the_norm(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    mesh = hp.Mesh(comm, {"dp": n}, backend=backend(), timeout=60)
    xp = mesh.backend.xp
    params = [hp.Parameter(xp.asarray(np.zeros((3, 2)))), hp.Parameter(xp.asarray(np.zeros(5)))]
    for p in params:
        p.grad[...] = r + 1.0
    reducer = hp.GradientReducer(mesh.group("dp"), [[p] for p in params], bucket_bytes=40)
    assert len(reducer.buckets) == 2
    reducer.reduce()
    total = n * (n + 1) / 2
    for p in params:
        np.testing.assert_array_equal(host(mesh, p.grad), total)
    assert abs(hp.grad_norm(params) - np.sqrt(11) * total) < 1e-9
    # a norm over the replicas would count each gradient n times: refused
    with pytest.raises(hp.HpcparError, match="data-parallel replicas"):
        hp.grad_norm(params, mesh.group("dp"))
    # over a group whose ranks hold different pieces, each rank's own pieces are counted
    pieces = [hp.Parameter(xp.asarray(np.zeros(5)), grad=xp.asarray(np.full(5, r + 1.0)))]
    want = np.sqrt(5 * sum((k + 1.0) ** 2 for k in range(n)))
    assert abs(hp.grad_norm(pieces, mesh.group("dp")) - want) < 1e-9
