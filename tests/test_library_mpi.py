"""The library as its users combine it, against torch on the dense model:
parameters found and named from layers and pipelines, optimizer state that never collides,
gradient norms and clipping that count every element once (a row-parallel bias and a norm
weight replicated over tp, a KV head replicated under GQA, dp replicas), the data-parallel
lifecycle that refuses a step on unreduced gradients, and ranks that disagree stopped with
one error on every rank.

The model (float64): h = x * g (g a norm-like weight, replicated over tp), q = h Wq^T + bq
(column-parallel by heads), kv = h Wkv^T + bkv (column-parallel by whole heads; one KV head
for two query heads per rank, so tp ranks hold it as replicas), z = q * kv repeated over the
query heads of each KV head, y = z Wo^T + bo (row-parallel, bias replicated), loss = sum of
squares of (y - t) over the global batch / its rows. Stage 0 is h..z, stage 1 is y and the
loss; with pp 1 one rank holds both.

On 2 ranks (tp 2, both stages on one rank) and 8 (dp 2 x pp 2 x tp 2: every axis at once).
"""

import numpy as np
import pytest

import hpcpar.parallel as hp
from hpcpar.parallel.tensor import ShardingError

pytestmark = pytest.mark.mpi(ranks=(2, 8))

D, HEADS, KV_HEADS, HD, OUT, ROWS, MICRO = 6, 4, 1, 3, 5, 8, 2
S0, R = hp.Shard(0), hp.Replicate()


def dims(n: int) -> dict:
    pp = 2 if n >= 4 else 1
    return {"dp": n // (2 * pp), "pp": pp, "tp": 2}


def weights(seed=0) -> dict:
    rng = np.random.default_rng(seed)                 # the same on every rank
    return dict(g=1 + 0.1 * rng.standard_normal(D),
                wq=rng.standard_normal((HEADS * HD, D)) / 3, bq=rng.standard_normal(HEADS * HD),
                wkv=rng.standard_normal((KV_HEADS * HD, D)) / 3,
                bkv=rng.standard_normal(KV_HEADS * HD),
                wo=rng.standard_normal((OUT, HEADS * HD)) / 3, bo=rng.standard_normal(OUT))


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((ROWS, D)), rng.standard_normal((ROWS, OUT))


class Front:
    """Stage 0: h = x * g, q and kv column-parallel, z = q * kv (per query head)."""

    def __init__(self, tp, w):
        self.norm = hp.Parameter(tp.xp.asarray(w["g"].copy()), decay=False, replicas=tp)
        self.q = hp.ColumnParallelLinear.from_full(tp, w["wq"], w["bq"], unit=HD)
        self.kv = hp.ColumnParallelLinear.from_full(tp, w["wkv"], w["bkv"], unit=HD)
        self.tp = tp

    def forward(self, x):
        h = x * self.norm.data
        q, _ = self.q.forward(h)
        kv, _ = self.kv.forward(h)
        heads = q.shape[1] // HD
        kv_rep = np.tile(kv, heads // (kv.shape[1] // HD))    # this rank's heads share one
        return q * kv_rep, (x, h, q, kv_rep)

    def backward(self, dz, ctx):
        x, h, q, kv_rep = ctx
        dq = dz * kv_rep
        dkv = (dz * q).reshape(len(dz), -1, self.kv.weight.data.shape[0]).sum(axis=1)
        dh = self.q.backward(dq, h) + self.kv.backward(dkv, h)   # each AllReduced over tp
        self.norm.grad += (dh * x).sum(axis=0)
        return dh * self.norm.data


class Back:
    """Stage 1: y = z Wo^T + bo, row-parallel."""

    def __init__(self, tp, w):
        self.out = hp.RowParallelLinear.from_full(tp, w["wo"], w["bo"])

    def forward(self, z):
        return self.out.forward(z)

    def backward(self, dy, z):
        return self.out.backward(dy, z)


class Both:
    """Both stages on one rank (pp 1)."""

    def __init__(self, tp, w):
        self.front, self.back = Front(tp, w), Back(tp, w)

    def forward(self, x):
        z, c0 = self.front.forward(x)
        y, c1 = self.back.forward(z)
        return y, (c0, c1)

    def backward(self, dy, ctx):
        return self.front.backward(self.back.backward(dy, ctx[1]), ctx[0])


def sse(y, t):
    d = y - t
    return float((d * d).sum() / ROWS), 2 * d / ROWS


def on_rank_0(comm, compute) -> dict[str, np.ndarray]:
    """``compute()``, a dict of float64 arrays, run on rank 0 and sent to every rank by
    buffer broadcasts: one rank imports torch and computes the reference, not all of them."""
    out = compute() if comm.Get_rank() == 0 else None
    shapes = comm.bcast(None if out is None else {k: v.shape for k, v in out.items()}, root=0)
    out = ({k: np.array(v, dtype=np.float64, order="C") for k, v in out.items()}
           if out is not None else {k: np.empty(shape) for k, shape in shapes.items()})
    for name in sorted(out):
        comm.Bcast(out[name], root=0)
    return out


def torch_reference(w, x, t, clip):
    """The dense model's loss, gradients (clipped as clip_grad_norm_ clips) and the norm."""
    import torch
    p = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    h = torch.tensor(x) * p["g"]
    q = h @ p["wq"].T + p["bq"]
    kv = h @ p["wkv"].T + p["bkv"]
    z = q * kv.repeat(1, HEADS // KV_HEADS)
    y = z @ p["wo"].T + p["bo"]
    loss = ((y - torch.tensor(t)) ** 2).sum() / ROWS
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(p.values()), clip)
    return {"loss": np.array(float(loss.detach())), "norm": np.array(float(norm)),
            **{f"grad.{k}": v.grad.numpy() for k, v in p.items()}}


def build(comm, w):
    mesh = hp.Mesh(comm, dims(comm.Get_size()), timeout=60)
    tp, pp = mesh.group("tp"), mesh.group("pp")
    stage = Both(tp, w) if pp.size == 1 else (Front(tp, w) if pp.rank == 0 else Back(tp, w))
    pipe = hp.Pipeline(pp, stage, loss=sse, schedule="1f1b")
    return mesh, stage, pipe


def my_rows(mesh, a):
    dp, r = mesh.size("dp"), mesh.coord("dp")
    return a[r * ROWS // dp:(r + 1) * ROWS // dp]


def test_named_parameters_of_layers_and_pipeline_stages(comm):
    mesh, stage, pipe = build(comm, weights())
    names = sorted(pipe.named_parameters())
    front = ["kv.bias", "kv.weight", "norm", "q.bias", "q.weight"]
    if mesh.size("pp") == 1:
        want = [f"stage0.{n}" for n in ["back.out.bias", "back.out.weight"]
                + [f"front.{m}" for m in front]]
    elif mesh.coord("pp") == 0:
        want = [f"stage0.{n}" for n in front]
    else:
        want = ["stage1.out.bias", "stage1.out.weight"]
    assert names == sorted(want)
    layer = stage.q if mesh.coord("pp") == 0 and mesh.size("pp") > 1 else None
    if layer is not None:
        assert layer.parameters() == [layer.weight, layer.bias]
        assert list(layer.named_parameters("q")) == ["q.weight", "q.bias"]
    # every Parameter once, and the optimizer keeps a state per parameter
    opt = hp.AdamW(pipe.named_parameters(), lr=1e-3)
    assert len(opt.state_dict()) == len(names)
    with pytest.raises(hp.HpcparError, match="listed twice"):
        hp.AdamW(pipe.parameters() * 2)
    with pytest.raises(hp.HpcparError, match="unique, non-empty parameter names"):
        hp.AdamW(pipe.parameters()).state_dict()


def test_a_stage_of_closures_names_the_parameters_it_is_given(comm):
    """Functions hold no parameters ``named_parameters`` can find: a ``Stage`` of closures
    lists none, and the ones given as ``params`` (a list, or a dict by name); an optimizer
    of them steps the weights the closures read."""
    n = comm.Get_size()
    mesh = hp.Mesh(comm, {"pp": n}, timeout=60)
    pp = mesh.group("pp")
    w = hp.Parameter(np.eye(3) * (1 + pp.rank))

    def forward(x):
        return x @ w.data.T, x

    def backward(dy, x):
        w.grad += dy.T @ x
        return dy @ w.data

    loss = lambda y, t: (float((y * y).sum()), 2 * y)        # noqa: E731
    assert hp.Pipeline(pp, hp.Stage(forward, backward), loss=loss).named_parameters() == {}
    as_dict = hp.Pipeline(pp, hp.Stage(forward, backward, params={"w": w}), loss=loss)
    assert as_dict.named_parameters() == {f"stage{pp.rank}.w": w}
    pipe = hp.Pipeline(pp, hp.Stage(forward, backward, params=[w]), loss=loss)
    assert pipe.named_parameters() == {f"stage{pp.rank}.0": w}
    opt = hp.SGD(pipe.named_parameters(), lr=0.1)
    before = w.data.copy()
    opt.zero_grad()
    pipe.train_step([np.ones((2, 3))] * 2, [None] * 2)
    assert np.abs(w.grad).sum() > 0
    opt.step()
    np.testing.assert_allclose(w.data, before - 0.1 * w.grad)
    mesh.free()


@pytest.mark.parametrize("clip", [1e9, 0.5])
def test_training_step_equals_torch_with_the_norm_counted_once(comm, clip):
    w = weights()
    x, t = batch()
    mesh, stage, pipe = build(comm, w)
    params = pipe.parameters()
    reducer = hp.GradientReducer(mesh.group("dp"), [params], bucket_bytes=64)
    opt = hp.AdamW(params, lr=0.01, weight_decay=0.1)      # unnamed: state by object
    opt.zero_grad()
    losses = pipe.train_step(hp.split_micro_batches(my_rows(mesh, x), MICRO),
                             hp.split_micro_batches(my_rows(mesh, t), MICRO))
    hp.data_parallel.sum_partial_grads(params)        # the KV head's replicas each added a part
    reducer.finish()
    norm = hp.grad_norm(params, mesh.group(("pp", "tp")))
    coef = hp.clip_coefficient(norm, clip)
    for p in params:
        p.grad *= coef

    ref = on_rank_0(comm, lambda: torch_reference(w, x, t, clip))
    loss, torch_norm = float(ref["loss"]), float(ref["norm"])
    grads = {k.split(".", 1)[1]: v for k, v in ref.items() if k.startswith("grad.")}
    assert abs(norm - torch_norm) <= 1e-12 * torch_norm
    if pipe.is_last:
        total = mesh.group("dp").on_host().all_reduce(np.array([sum(losses)]))[0]
        assert abs(total - loss) <= 1e-12 * abs(loss)
    tp_rank = mesh.coord("tp")
    heads = slice(tp_rank * HEADS // 2 * HD, (tp_rank + 1) * HEADS // 2 * HD)
    for name, p in pipe.named_parameters().items():
        key = name.split(".", 1)[1].replace("front.", "").replace("back.", "")
        want = {"norm": grads["g"], "q.weight": grads["wq"][heads],
                "q.bias": grads["bq"][heads], "kv.weight": grads["wkv"],
                "kv.bias": grads["bkv"], "out.weight": grads["wo"][:, heads],
                "out.bias": grads["bo"]}[key]
        np.testing.assert_allclose(p.grad, want, rtol=1e-10, atol=1e-13, err_msg=name)
    opt.step()
    with pytest.raises(hp.HpcparError, match="not summed over the data-parallel"):
        opt.step()                      # no finish() since the last step
    mesh.free()


def test_the_data_parallel_lifecycle_refuses_what_would_drift(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    mesh = hp.Mesh(comm, {"dp": n}, timeout=60)
    params = [hp.Parameter(np.zeros(3)), hp.Parameter(np.zeros((2, 2)))]
    reducer = hp.GradientReducer(mesh.group("dp"), [params[:1], params[1:]], bucket_bytes=8)
    opt = hp.SGD(params, lr=1.0)
    with pytest.raises(hp.HpcparError, match="not summed over the data-parallel"):
        opt.step()
    for step in range(2):          # grads_done + finish, no start_step: the documented path
        opt.zero_grad()
        for p in reversed(params):
            p.grad += r + 1.0
            reducer.grads_done([p])
        reducer.finish()
        for p in params:
            np.testing.assert_array_equal(p.grad, n * (n + 1) / 2)
        with pytest.raises(hp.HpcparError, match="already summed over dp"):
            reducer.finish()
        opt.step()
    np.testing.assert_array_equal(params[0].data, -n * (n + 1))    # two equal steps
    opt.zero_grad()
    for micro_batch in range(2):    # accumulation: reported once, after its last micro-batch
        for p in params:
            p.grad += (r + 1.0) * 10 ** micro_batch
        if micro_batch == 1:
            reducer.grads_done(params)
    reducer.finish()
    for p in params:
        np.testing.assert_array_equal(p.grad, 11 * n * (n + 1) / 2)
    opt.zero_grad()
    params[0].grad += 1.0
    reducer.grads_done(params[:1])   # its bucket's sum may start: a later addition is lost
    with pytest.raises(hp.HpcparError, match="already reported complete in this step"):
        reducer.grads_done(params[:1])
    opt.zero_grad()
    params[0].grad = np.ones(3)                       # replaced: the sum would miss it
    with pytest.raises(hp.HpcparError, match="replaced by a new array"):
        reducer.finish()
    mesh.free()


def test_a_partial_gradient_must_be_summed_before_the_norm_and_the_step(comm):
    """A parameter whose tp replicas each add a part of its gradient (``partial_grad``):
    a norm or a step before ``sum_partial_grads`` is an error (each replica would step
    with its own part and the copies drift); after it, every copy takes the same step."""
    n, r = comm.Get_size(), comm.Get_rank()
    tp = hp.Mesh(comm, {"tp": n}, timeout=60).group("tp")
    p = hp.Parameter(np.zeros(4), replicas=tp, partial_grad=True, name="kv")
    opt = hp.SGD([p], lr=1.0)
    for _ in range(2):
        opt.zero_grad()
        p.grad += r + 1.0
        with pytest.raises(hp.HpcparError, match="not summed since the last step"):
            hp.grad_norm([p], tp)
        with pytest.raises(hp.HpcparError, match="call sum_partial_grads"):
            opt.step()
        hp.data_parallel.sum_partial_grads([p])
        assert hp.grad_norm([p], tp) == pytest.approx(2 * n * (n + 1) / 2)
        opt.step()
    np.testing.assert_array_equal(p.data, -n * (n + 1))      # two whole-gradient steps


def _raises_everywhere(comm, fn, match):
    """``fn`` raises ``Disagreement`` matching ``match`` on every rank (no hang)."""
    with pytest.raises(hp.comm.agreement.Disagreement, match=match):
        fn()
    comm.Barrier()


def test_ranks_that_disagree_are_one_error_on_every_rank(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    mesh = hp.Mesh(comm, {"x": n}, timeout=30)
    full = np.arange(4.0 * n * 6).reshape(4 * n, 6)
    a = hp.DArray.from_full(full, mesh, {"x": hp.Shard(0)})
    odd = r == n - 1
    _raises_everywhere(comm, lambda: hp.Mesh(comm, {"y" if odd else "x": n}),
                       rf"Mesh: the ranks disagree on axes: .* on rank {n - 1}")
    _raises_everywhere(comm, lambda: hp.DArray.from_full(np.zeros((4 * n, 6 + odd)), mesh,
                                                         {"x": hp.Shard(0)}),
                       rf"global shape: \(.*, 6\) on ranks? 0.* and \(.*, 7\) on rank {n - 1}")
    _raises_everywhere(comm, lambda: hp.DArray.from_full(
        full.astype(np.float32 if odd else np.float64), mesh, {"x": hp.Shard(0)}), "dtype")
    _raises_everywhere(comm, lambda: hp.DArray(np.zeros((4 + odd, 6)), (4 * n, 6), mesh,
                                               {"x": hp.Shard(0)}),
                       rf"local array of shape \(5, 6\) .* \(found on rank {n - 1}\)")
    _raises_everywhere(comm, lambda: hp.DArray.from_local(np.zeros((2,) * (1 + odd)), mesh,
                                                          {"x": hp.Shard(0)}), "ndim")
    _raises_everywhere(comm, lambda: a.redistribute({"x": hp.Replicate() if odd else
                                                      hp.Shard(0)}), "target placements")
    other = hp.Mesh(comm, {"x": n}, timeout=30)
    b = hp.DArray.from_full(np.ones((6, 3)), mesh, {"x": hp.Replicate()})
    b_elsewhere = hp.DArray.from_full(np.ones((6, 3)), other, {"x": hp.Replicate()})
    _raises_everywhere(comm, lambda: hp.matmul(a, b_elsewhere if odd else b),
                       rf"different meshes; build both on one Mesh \(found on rank {n - 1}\)")
    _raises_everywhere(comm, lambda: hp.matmul(a, b, policy="outer" if odd else None),
                       "matmul: .* policy")
    _raises_everywhere(comm, lambda: hp.matmul(a, b, out={"x": hp.Shard(0)} if odd else None),
                       "matmul: .* out")
    tp = mesh.group("x")
    _raises_everywhere(comm, lambda: hp.RowParallelLinear.from_full(
        tp, np.ones((3, n * (2 + odd)))), "RowParallelLinear.from_full: .* weight's shape")
    _raises_everywhere(comm, lambda: hp.RowParallelLinear.from_full(   # bad on one rank
        tp, np.ones((3, 2 * n + odd))), rf"does not split evenly .*found on rank {n - 1}\)")
    _raises_everywhere(comm, lambda: tp.all_reduce(np.ones(3 + odd)),
                       r"all_reduce on the x group: the ranks disagree on shape")
    _raises_everywhere(comm, lambda: tp.all_gather(np.ones((2, 3 + odd))), "shape")
    _raises_everywhere(comm, lambda: hp.GradientReducer(
        tp, [[hp.Parameter(np.zeros(2 + odd))]]), "parameters")
    stage = hp.Stage(lambda x: (x, None), lambda dy, ctx: dy)
    pipe = hp.Pipeline(tp, stage, loss=lambda y, t: (0.0, y), schedule="gpipe")
    m = n + 2 * odd
    _raises_everywhere(comm, lambda: pipe.train_step([np.ones(2)] * m, [None] * m),
                       r"micro-batch count \(the length of inputs\): "
                       rf"{n} on ranks? 0.* and {n + 2} on rank {n - 1}")
    # checks off: nothing is exchanged, and the mesh says so
    quiet = hp.Mesh(comm, {"x": n}, check=False)
    assert not quiet.group("x").check
    for m in (mesh, other, quiet):
        m.free()


def test_remembered_redistributions_and_products_are_still_checked(comm):
    """A redistribution or product repeated in a loop reuses what it worked out the first
    time (its program, its check's fingerprint); one rank repeating it while another asks
    for something new is still an error on every rank, and a remembered one still gives
    the dense result."""
    n, r = comm.Get_size(), comm.Get_rank()
    mesh = hp.Mesh(comm, {"x": n}, timeout=30)
    full = np.arange(2.0 * n * 3 * n).reshape(2 * n, 3 * n)
    a = hp.DArray.from_full(full, mesh, [hp.Shard(0)])
    for _ in range(3):                                   # made once, then remembered
        np.testing.assert_array_equal(a.redistribute([hp.Shard(1)]).full(), full)
        np.testing.assert_array_equal(a.redistribute({"x": hp.Replicate()}).local, full)
    assert len(mesh.programs) >= 2
    odd = r == n - 1
    _raises_everywhere(comm, lambda: a.redistribute([hp.Replicate() if odd else hp.Shard(1)]),
                       r"target placements: \(Shard\(1\),\) on ranks? 0.* and "
                       rf"\(Replicate\(\),\) on rank {n - 1}")
    _raises_everywhere(comm, lambda: a.redistribute([hp.Shard(1 - odd)]), "target placements")
    b = hp.DArray.from_full(full.astype(np.float32), mesh, [hp.Shard(0)])
    b.redistribute([hp.Shard(1)])                        # remembered for float32 on every rank
    _raises_everywhere(comm, lambda: (b if odd else a).redistribute([hp.Shard(1)]), "dtype")
    w_full = np.arange(3.0 * n * 2).reshape(3 * n, 2)
    w = hp.DArray.from_full(w_full, mesh, [hp.Replicate()])
    for _ in range(2):                                   # the product's check remembered
        np.testing.assert_allclose(hp.matmul(a, w, out=[hp.Shard(0)]).full(), full @ w_full)
    _raises_everywhere(comm, lambda: hp.matmul(a, w, out=None if odd else [hp.Shard(0)]),
                       "matmul: the ranks disagree on out")
    same = hp.matmul(a, w, out=(hp.Shard(0),) if odd else [hp.Shard(0)])    # a tuple is a list
    np.testing.assert_allclose(same.full(), full @ w_full)
    mesh.free()


def test_prepared_collectives_equal_the_calls_they_stand_for(comm):
    """``all_gather_op`` / ``reduce_scatter_op`` / ``all_to_all_op``, against NumPy."""
    n, r = comm.Get_size(), comm.Get_rank()
    mesh = hp.Mesh(comm, {"x": n}, timeout=30)
    group = mesh.group("x")
    rng = np.random.default_rng(0)
    every = rng.standard_normal((n, 3, 2 * n, 4))            # rank j's operand: every[j]
    mine = every[r]
    lengths = [1 + j % 2 for j in range(n)]                  # uneven blocks along axis 1
    uneven = every[:, :, :max(lengths)]
    gather = group.all_gather_op((3, lengths[r], 4), mine.dtype, axis=1, sizes=lengths)
    np.testing.assert_array_equal(
        gather(np.ascontiguousarray(uneven[r, :, :lengths[r]])),
        np.concatenate([uneven[j, :, :lengths[j]] for j in range(n)], axis=1))
    out = np.empty((3, 2 * n * n, 4))
    assert group.all_gather_op(mine.shape, mine.dtype, axis=-2)(mine, out) is out
    np.testing.assert_array_equal(out, np.concatenate(list(every), axis=1))
    scatter = group.reduce_scatter_op(mine.shape, mine.dtype, axis=2)
    np.testing.assert_allclose(scatter(mine), np.array_split(every.sum(0), n, 2)[r])
    exchange = group.all_to_all_op(mine.shape, mine.dtype, split_axis=1, concat_axis=0)
    np.testing.assert_array_equal(exchange(mine), np.concatenate(
        [every[j][:, 2 * r:2 * r + 2] for j in range(n)], axis=0))
    with pytest.raises(hp.HpcparError, match="sizes"):   # bad input: one rank, no collective
        group.all_gather_op((3, 2), mine.dtype, sizes=[1] * (n + 1))
    mesh.free()


def test_cross_entropy_ignores_label_minus_one_and_refuses_what_it_cannot_score(comm):
    """Label -1 adds nothing to the loss or the gradient, whatever its weight, and its
    token loss and log-probability are 0 (torch's ignore_index); labels outside the
    vocabulary and logits that are not this rank's block are one error, not a number."""
    tp = hp.Mesh(comm, {"tp": comm.Get_size()}, timeout=30).group("tp")
    V, rows = 11, 5
    rng = np.random.default_rng(3)
    full = rng.standard_normal((rows, V))
    labels = np.array([4, -1, 7, -1, 0])
    ce = hp.VocabParallelCrossEntropy(None, V, tp)
    width = -(-V // tp.size)
    block = np.full((rows, width), -np.inf)
    start = tp.rank * width
    block[:, :max(0, min(V - start, width))] = full[:, start:start + width]
    loss, ctx = ce.forward(block.copy(), labels, np.ones(rows))

    def torch_cross_entropy():
        import torch
        per_token = torch.nn.functional.cross_entropy(torch.tensor(full), torch.tensor(labels),
                                                      ignore_index=-1, reduction="none")
        logits = torch.tensor(full, requires_grad=True)
        total = torch.nn.functional.cross_entropy(logits, torch.tensor(labels),
                                                  ignore_index=-1, reduction="sum")
        total.backward()
        return {"per_token": per_token.numpy(), "sum": np.array(total.item()),
                "grad": logits.grad.numpy()}

    want = on_rank_0(comm, torch_cross_entropy)
    np.testing.assert_allclose(ce.token_losses(block.copy(), labels), want["per_token"],
                               atol=1e-12)
    logp, _ = ce.label_logprobs(block.copy(), labels)
    np.testing.assert_allclose(logp, -want["per_token"], atol=1e-12)
    assert abs(float(loss) - float(want["sum"])) < 1e-12
    grad = ce.backward(ctx)
    np.testing.assert_allclose(grad[:, :max(0, min(V - start, width))],
                               want["grad"][:, start:start + width], atol=1e-12)
    with pytest.raises(hp.HpcparError, match="below the vocabulary's 11, or -1"):
        ce.forward(block.copy(), np.array([4, 11, 7, 0, 0]), np.ones(rows))
    with pytest.raises(hp.HpcparError, match="floating-point logits and integer labels"):
        ce.forward(block.astype(np.int64), labels, np.ones(rows))
    if tp.size > 1:
        with pytest.raises(hp.HpcparError, match=f"this rank's block of the logits, .rows, "
                                                 f"{width}."):
            ce.forward(full.copy(), labels, np.ones(rows))


@pytest.mark.mpi(min_size=4)               # a 2 x 2 mesh
def test_nested_uneven_shards_are_checked_at_every_coordinate(comm):
    """An inner axis's sizes that fit one outer piece and not another are the same error on
    every rank (they were accepted on some and refused on others, who then waited)."""
    mesh = hp.Mesh(comm, {"a": 2, "b": 2}, timeout=30)
    with pytest.raises(ShardingError, match=r"sizes \[1, 1\] for a dimension 0 of length 6"):
        hp.DArray.from_full(np.zeros((8, 2)), mesh, {"a": hp.Shard(0, sizes=(2, 6)),
                                                     "b": hp.Shard(0, sizes=(1, 1))})
    mesh.free()


def test_an_empty_dict_of_gradient_placements_means_replicated(comm):
    mesh = hp.Mesh(comm, {"x": comm.Get_size()}, timeout=30)
    n = 2 * comm.Get_size()
    a = hp.DArray.from_full(np.ones((n, 3)), mesh, {"x": S0})
    b = hp.DArray.from_full(np.ones((3, 2)), mesh, {})
    y, ctx = hp.tensor.matmul_forward(a, b)
    da, db = hp.tensor.matmul_backward(y, ctx, da_placements={}, db_placements={})
    assert da.placements == (R,) and db.placements == (R,)
    mesh.free()
