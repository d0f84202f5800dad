"""Mixtures of experts: the core's MoE layer against a dense torch computation of the same
layer (forward and every gradient), alone and split over ep x tp; the router's
load-balancing loss in a training step against transformers' own; expert parallelism in
training, scoring and generation against the single rank and transformers, replicas of very
unequal work included; resuming across ep sizes; and bad input.

The families' parity at one rank (generation, scoring, training against torch, export) runs
in the suites that take every model of ``helpers.HF_CONFIGS``, which holds one of each."""

import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import (PROMPTS, WORLD_SIZES, build_hf_model, link_into, losses, made_once,
                     mpirun)
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.jobs.score.engine import run_scoring
from hpcpar.jobs.train.engine import run_training

E, HIDDEN, INTER, TOP_K, TOKENS = 8, 16, 12, 2, 10


def _layer(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((E, HIDDEN)), 0.3 * rng.standard_normal((E, INTER, HIDDEN)),
            0.3 * rng.standard_normal((E, INTER, HIDDEN)),
            0.3 * rng.standard_normal((E, HIDDEN, INTER)))


def _torch_moe(weights, x, dy, normalize):
    """The layer written densely in torch (every expert on every token, masked by the
    router's choice), and its gradients by autograd: the independent reference."""
    import torch
    router, gate, up, down = (torch.tensor(w, requires_grad=True) for w in weights)
    xt = torch.tensor(x, requires_grad=True)
    probs = torch.softmax((xt @ router.T).float(), dim=-1)
    top, chosen = torch.topk(probs, TOP_K, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    weight = torch.zeros_like(probs).scatter(1, chosen, top).to(xt.dtype)      # (N, E)
    h = torch.nn.functional.silu(torch.einsum("nh,eih->nei", xt, gate)) \
        * torch.einsum("nh,eih->nei", xt, up)
    y = torch.einsum("nei,ehi,ne->nh", h, down, weight)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy(), [w.grad.numpy() for w in
                                                  (router, gate, up, down)]


def _check_grads(moe, ref_grads, experts, cut):
    """This rank's parameters' gradients against the reference's slices."""
    d_router, d_gate, d_up, d_down = ref_grads
    np.testing.assert_allclose(moe.router.weight.grad, d_router, rtol=1e-5, atol=1e-6)
    for j, e in enumerate(experts):
        (gate, up), down = moe.experts.gate_up[j], moe.experts.down[j]
        np.testing.assert_allclose(gate.grad, d_gate[e, cut], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(up.grad, d_up[e, cut], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(down.grad, d_down[e][:, cut], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_moe_layer_is_the_dense_computation_forward_and_backward(normalize):
    import hpcpar.parallel as hp
    from hpcpar.parallel.comm import create_communicator
    weights = _layer()
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 5, HIDDEN)), rng.standard_normal((2, 5, HIDDEN))
    ep = create_communicator(MPI.COMM_SELF, "mpi", name="ep")
    moe = hp.MoE.from_full(*weights, TOP_K, normalize, ep=ep)
    y, ctx = moe.forward(x, train=True)
    dx = moe.backward(dy, ctx)
    ref_y, ref_dx, ref_grads = _torch_moe(weights, x.reshape(-1, HIDDEN),
                                          dy.reshape(-1, HIDDEN), normalize)
    # the router's softmax is float32, as transformers computes it
    np.testing.assert_allclose(y.reshape(-1, HIDDEN), ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx.reshape(-1, HIDDEN), ref_dx, rtol=1e-5, atol=1e-6)
    _check_grads(moe, ref_grads, range(E), slice(0, INTER))
    assert moe.tokens_per_expert.sum() == 10 * TOP_K


@pytest.mark.gpu
def test_the_moe_layer_on_cupy_arrays_is_numpys():
    """One rank on a GPU: the layer's forward and backward keep CuPy arrays on the device and
    equal the NumPy layer's (not yet run on a GPU)."""
    import cupy as cp

    import hpcpar.parallel as hp
    from hpcpar.parallel.device.backend import select_backend
    from hpcpar.parallel.comm import create_communicator
    weights = [w.astype(np.float32) for w in _layer()]
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32) for _ in range(2))
    results = []
    for backend in (select_backend("numpy"), select_backend("cupy")):
        ep = create_communicator(MPI.COMM_SELF, "mpi", backend, name="ep")
        moe = hp.MoE.from_full(*weights, TOP_K, True, ep=ep)
        y, ctx = moe.forward(backend.xp.asarray(x), train=True)
        dx = moe.backward(backend.xp.asarray(dy), ctx)
        if backend.on_device:
            assert isinstance(y, cp.ndarray) and isinstance(dx, cp.ndarray)
        results.append([backend.to_host(a) for a in (y, dx, moe.router.weight.grad)])
    for ours, theirs in zip(*results):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_arrays_that_are_not_one_moe_layer_are_one_error():
    import hpcpar.parallel as hp
    from hpcpar.parallel.comm import create_communicator
    ep = create_communicator(MPI.COMM_SELF, "mpi", name="ep")
    router, gate, up, down = _layer()
    for change, words in [({"top_k": E + 1}, "top_k 9 must be an integer from 1 to the 8"),
                          ({"top_k": 0}, "top_k 0 must be"),
                          ({"up": up[:, :-1]}, "up (8, 11, 16) (expected (8, 12, 16))"),
                          ({"down": down[..., :5]}, "down (8, 16, 5) (expected (8, 16, 12))"),
                          ({"router": router[:, :3]}, "router (8, 3) (expected (8, 16))")]:
        args = dict(router=router, gate=gate, up=up, down=down, top_k=TOP_K) | change
        with pytest.raises(hp.HpcparError, match=re.escape(words)):
            hp.MoE.from_full(**args, ep=ep)
    moe = hp.MoE.from_full(router, gate, up, down, TOP_K, ep=ep)
    with pytest.raises(hp.HpcparError, match="the layer takes 16 features"):
        moe.forward(np.zeros((3, HIDDEN - 1)))


@pytest.mark.mpi(ranks=(4,))               # ep 2 x tp 2
def test_the_moe_layer_split_over_ep_and_tp_is_the_dense_computation(comm):
    """Each ep rank routes its own tokens (some to experts elsewhere); a rank with no tokens
    at all still serves its experts; each rank's outputs, input gradients and parameter
    gradients (the router's summed over ep, as data parallelism would) are the dense
    layer's."""
    import hpcpar.parallel as hp
    size = comm.Get_size()
    ep_size = 2 if size % 2 == 0 else 1
    mesh = hp.Mesh(comm, {"ep": ep_size, "tp": size // ep_size})
    weights = _layer()
    rng = np.random.default_rng(2)
    counts = [TOKENS, 0][:ep_size] if ep_size > 1 else [TOKENS]      # the second has none
    xs = [rng.standard_normal((n, HIDDEN)) for n in counts]
    dys = [rng.standard_normal((n, HIDDEN)) for n in counts]
    me = mesh.coord("ep")
    moe = hp.MoE.from_full(*weights, TOP_K, True, ep=mesh.group("ep"), tp=mesh.group("tp"))
    y, ctx = moe.forward(xs[me], train=True)
    dx = moe.backward(dys[me], ctx)
    ref_y, ref_dx, ref_grads = _torch_moe(weights, np.concatenate(xs), np.concatenate(dys),
                                          True)
    rows = slice(sum(counts[:me]), sum(counts[:me + 1]))
    np.testing.assert_allclose(y, ref_y[rows], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, ref_dx[rows], rtol=1e-5, atol=1e-6)
    mesh.group("ep").all_reduce(moe.router.weight.grad)
    tp, t = mesh.size("tp"), mesh.coord("tp")
    per = E // ep_size
    _check_grads(moe, ref_grads, range(me * per, (me + 1) * per),
                 slice(t * INTER // tp, (t + 1) * INTER // tp))


@pytest.mark.mpi(ranks=(2, 4))            # ep 2, ep 2 x tp 2
@pytest.mark.parametrize("summed_by", ["reducer", "all_reduce"])
def test_the_gradient_norm_under_ep_is_the_dense_layers(comm, summed_by):
    """The router, replicated over ep and tp (its ``replicas``), summed over ep by a
    ``GradientReducer`` or an all-reduce, counts once in ``grad_norm`` over the group of ep
    and tp, beside every expert's slices: the norm of the dense layer's gradients. A group
    that leaves out some of the router's replicas is refused."""
    import hpcpar.parallel as hp
    size = comm.Get_size()
    mesh = hp.Mesh(comm, {"ep": 2, "tp": size // 2}, timeout=60)
    ep = mesh.group("ep")
    weights = _layer(3)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((n, HIDDEN)) for n in (TOKENS, 7)]
    dys = [rng.standard_normal((n, HIDDEN)) for n in (TOKENS, 7)]
    moe = hp.MoE.from_full(*weights, TOP_K, True, ep=ep, tp=mesh.group("tp"))
    router = moe.router.weight
    reducer = hp.GradientReducer(ep, [[router]]) if summed_by == "reducer" else None
    y, ctx = moe.forward(xs[ep.rank], train=True)
    moe.backward(dys[ep.rank], ctx)
    if reducer is not None:
        reducer.finish()
    else:
        ep.all_reduce(router.grad)
    norm = hp.grad_norm(moe.parameters(), mesh.group(("ep", "tp")))
    _, _, ref_grads = _torch_moe(weights, np.concatenate(xs), np.concatenate(dys), True)
    want = np.sqrt(sum(float((g * g).sum()) for g in ref_grads))
    assert norm == pytest.approx(want, rel=1e-6)
    if mesh.size("tp") > 1:
        with pytest.raises(hp.HpcparError, match="replicas only in part"):
            hp.grad_norm(moe.parameters(), ep)
    mesh.free()


# ---- the load-balancing loss in training ---------------------------------------------------

def _rows():
    rows = np.random.default_rng(1).integers(0, 250, (4, 9))
    rows[1, :3] = -1                      # left padding: out of the loss and the routing
    rows[2, :1] = -1
    return rows


def _torch_step_with_aux(hf, rows, coef, lr):
    """One SGD step of transformers' model on ``rows``' inputs (the last token of each row
    is only a label), loss = cross-entropy + coef * load_balancing_loss_func over the real
    tokens. Returns (loss, aux, grad norm)."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    batch = torch.from_numpy(rows)
    mask = (batch >= 0).long()
    ids, labels = batch.clamp(min=0), batch.clone()
    labels[torch.arange(len(batch)), mask.argmax(dim=1)] = -100
    labels[mask == 0] = -100
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    hf.train()
    out = hf(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
             output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                           labels[:, 1:].reshape(-1), ignore_index=-100)
    aux = load_balancing_loss_func(out.router_logits, hf.config.num_experts,
                                   hf.config.num_experts_per_tok, mask[:, :-1])
    loss = ce + coef * aux
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters()
                          if p.grad is not None))
    with torch.no_grad():
        for p in hf.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return loss.item(), aux.item(), norm.item()


@pytest.mark.device
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_a_training_step_with_the_load_balancing_loss_is_transformers(tmp_path, family):
    """Loss, aux loss (transformers' load_balancing_loss_func, padding masked), gradient
    norm and the weights after an SGD step; metrics.jsonl also reports each MoE layer's
    expert load, which sums to the real tokens' top-k choices."""
    from test_train_torch import saved_state
    hf, checkpoint = build_hf_model(family, tmp_path)
    rows = _rows()
    np.save(tmp_path / "data.npy", rows)
    coef, lr = 0.05, 0.1
    want_loss, want_aux, want_norm = _torch_step_with_aux(hf, rows, coef, lr)
    run_training(MPI.COMM_SELF, load_job(None, [
        f"model.checkpoint='{checkpoint}'", f"data.dataset='{tmp_path}/data.npy'",
        f"output.path='{tmp_path}/out'", "train.steps=1", "train.global_batch=4",
        "train.optimizer='sgd'", f"train.lr={lr}", "train.momentum=0.0",
        "train.weight_decay=0.0", "train.clip_grad=0.0", "train.peak_tflops=1.0",
        f"train.aux_loss_coef={coef}"]), progress=False)
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["aux_loss"] == pytest.approx(want_aux, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
    routed = len(hf.config.mlp_only_layers or []) if family == "qwen3_moe" else 0
    assert len(metrics["expert_load"]) == hf.config.num_hidden_layers - routed
    assert all(0 <= low <= high for low, high in metrics["expert_load"])
    state = saved_state(hf, tmp_path / "trained-hf")
    with h5py.File(tmp_path / "out" / "step-1.h5") as f:
        for name in f:
            if isinstance(f[name], h5py.Dataset):
                np.testing.assert_allclose(f[name][()], state[name], rtol=1e-5, atol=1e-6,
                                           err_msg=name)


# ---- expert parallelism in the jobs --------------------------------------------------------

def _shared(tmp_path_factory, name, build):
    comm = MPI.COMM_WORLD
    folder = str(tmp_path_factory.mktemp(name)) if comm.Get_rank() == 0 else None
    folder = comm.bcast(folder, root=0)
    model = build(folder) if comm.Get_rank() == 0 else None
    comm.Barrier()
    return folder, model


# (dp, pp, tp, ep, micro_batches, schedule, zero stage), by world size. The load-balancing loss is
# each micro-batch's (transformers' on it), so where it is on (pp 1) the step's dp x
# micro_batches is the single rank's 4: the same micro-batches of the same rows.
TRAIN_EP = {
    2: [(2, 1, 1, 2, 2, "1f1b", 0), (2, 1, 1, 2, 2, "1f1b", 3)],
    4: [(4, 1, 1, 2, 1, "1f1b", 1), (2, 2, 1, 2, 2, "1f1b", 3), (2, 1, 2, 2, 2, "gpipe", 2),
        (4, 1, 1, 4, 1, "1f1b", 0)],
    8: [(2, 2, 2, 2, 2, "1f1b", 0), (4, 2, 1, 4, 2, "zb-h1", 3), (4, 1, 2, 4, 1, "1f1b", 1)],
}
SINGLE_MICRO_BATCHES = 4
AUX = 0.02


def _train_job(folder, out, layout, steps=2, *extra):
    """The job of ``layout``, with the load-balancing loss where pp is 1 (a single-rank
    reference ``single-aux``, else ``single-plain``)."""
    dp, pp, tp, ep, m, schedule, zero = layout
    aux = AUX if pp == 1 and not out.startswith("single-plain") else 0.0
    return load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/data.npy'",
        f"output.path='{folder}/{out}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
        f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.micro_batches={m}",
        f"parallel.schedule='{schedule}'", f"train.steps={steps}", "train.global_batch=8",
        "train.lr=0.01", "train.weight_decay=0.1", "train.warmup_steps=1",
        "train.clip_grad=0.5", "train.peak_tflops=1.0", "train.eps=1e-6", f"train.zero={zero}",
        f"train.aux_loss_coef={aux}", *extra])


@pytest.fixture(scope="module")
def moe_training(tmp_path_factory):
    """Qwen3-MoE (8 experts, a dense layer between routed ones), rows with left padding, and
    the single-rank runs with and without the load-balancing loss (rank 0)."""
    def build(folder):
        build_hf_model("qwen3_moe", Path(folder))
        rows = np.random.default_rng(1).integers(0, 250, (24, 9))
        rows[3, :4] = -1
        np.save(f"{folder}/data.npy", rows)
        for out in ("single-aux", "single-plain"):
            run_training(MPI.COMM_SELF, _train_job(
                folder, out, (1, 1, 1, 1, SINGLE_MICRO_BATCHES, "1f1b", 0)), progress=False)
    comm = MPI.COMM_WORLD
    folder = str(tmp_path_factory.mktemp("moe-train")) if comm.Get_rank() == 0 else None
    folder = comm.bcast(folder, root=0)
    if comm.Get_rank() == 0:                 # the references: once for every world size
        link_into(Path(folder), made_once("test_moe moe_training", build))
    comm.Barrier()
    return folder


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
def test_training_under_expert_parallelism_reproduces_the_single_rank_steps(moe_training):
    from test_train_mpi import assert_same_checkpoint
    comm = MPI.COMM_WORLD
    folder = moe_training
    for i, layout in enumerate(TRAIN_EP[comm.Get_size()]):
        out = f"ep{comm.Get_size()}-{i}"
        run_training(comm, _train_job(folder, out, layout), progress=False)
        if comm.Get_rank() == 0:
            single = f"{folder}/single-{'plain' if layout[1] > 1 else 'aux'}"
            np.testing.assert_allclose(losses(f"{folder}/{out}"), losses(single), rtol=1e-5,
                                       err_msg=str(layout))
            assert_same_checkpoint(f"{folder}/{out}/step-2.h5", f"{single}/step-2.h5",
                                   f"{folder}/model.h5")
            metrics = [json.loads(line) for line in open(f"{folder}/{out}/metrics.jsonl")]
            ref = [json.loads(line) for line in open(f"{single}/metrics.jsonl")]
            assert [m["expert_load"] for m in metrics] == [m["expert_load"] for m in ref]
            if layout[1] == 1:
                assert [m["aux_loss"] for m in metrics] == pytest.approx(
                    [m["aux_loss"] for m in ref], rel=1e-5)
        comm.Barrier()


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))               # ep 2 -> ep 1 and ep 4
def test_a_checkpoint_saved_under_one_ep_resumes_under_another(moe_training):
    """Step 1 under ep 2, step 2 under ep 1 and under ep 4: the straight single-rank run's
    weights, optimizer state and losses."""
    from test_train_mpi import assert_same_checkpoint
    comm = MPI.COMM_WORLD
    folder, size = moe_training, comm.Get_size()
    dp = min(size, SINGLE_MICRO_BATCHES)
    tp, m = size // dp, SINGLE_MICRO_BATCHES // dp
    run_training(comm, _train_job(folder, f"resume{size}", (dp, 1, tp, 2, m, "1f1b", 0), 1),
                 progress=False)
    for ep in sorted({1, min(4, dp)}):
        shutil_dir = f"{folder}/resume{size}-ep{ep}"
        if comm.Get_rank() == 0:
            shutil.copytree(f"{folder}/resume{size}", shutil_dir)
        comm.Barrier()
        run_training(comm, _train_job(folder, f"resume{size}-ep{ep}",
                                      (dp, 1, tp, ep, m, "1f1b", 0), 2, "train.resume='auto'"),
                     progress=False)
        if comm.Get_rank() == 0:
            np.testing.assert_allclose(losses(shutil_dir), losses(f"{folder}/single-aux"),
                                       rtol=1e-5)
            assert_same_checkpoint(f"{shutil_dir}/step-2.h5", f"{folder}/single-aux/step-2.h5",
                                   f"{folder}/model.h5")
        comm.Barrier()


SCORE_EP = {2: [(2, 1, 1, 2, 1)], 4: [(4, 1, 1, 4, 2), (2, 2, 1, 2, 2), (2, 1, 2, 2, 2)],
            8: [(2, 2, 2, 2, 1), (8, 1, 1, 4, 2)]}


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_scoring_under_expert_parallelism_is_transformers(tmp_path_factory, family):
    """Nine rows over the replicas: some replicas hold fewer micro-batches (or none) and
    serve their experts to the others until all are done."""
    from test_score import _padded, check_against, transformers_logprobs
    rows = [*PROMPTS, np.arange(3, 9), np.array([5, 6, 7])]

    def build(folder):
        np.save(f"{folder}/rows.npy", _padded(rows))
        return transformers_logprobs(build_hf_model(family, Path(folder))[0], rows)

    folder, expected = _shared(tmp_path_factory, f"score-{family}", build)
    comm = MPI.COMM_WORLD
    offsets = [max(len(p) for p in rows) - len(p) for p in rows]
    for dp, pp, tp, ep, m in SCORE_EP[comm.Get_size()]:
        out = f"{folder}/scores-{dp}{pp}{tp}{ep}{m}.h5"
        result = run_scoring(comm, load_job(None, [
            f"model.checkpoint='{folder}/model.h5'", f"score.data='{folder}/rows.npy'",
            f"output.path='{out}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.micro_batches={m}"]))
        if comm.Get_rank() == 0:
            check_against(result, expected, offsets)


GENERATE_EP = {2: [(2, 1, 1, 2, 1)], 4: [(4, 1, 1, 2, 2), (2, 2, 1, 2, 2), (2, 1, 2, 2, 1)],
               8: [(2, 2, 2, 2, 2), (8, 1, 1, 4, 1)]}


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_replicas_of_very_unequal_work_generate_transformers_tokens_under_ep(
        tmp_path_factory, batching):
    """The first replica gets the two long prompts (18 and 20 new tokens), the others one
    or two tokens each: they finish long before it, and serve its tokens' experts until it
    is done. No hang, no prompt lost, every token transformers' greedy one."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 250, n) for n in (6, 2, 13, 4, 9, 1, 11, 7, 3)]
    limits = [20, 1, 2, 1, 18, 1, 1, 2, 1]

    def build(folder):
        import torch
        model = build_hf_model("mixtral", Path(folder))[0]
        with torch.no_grad():
            return [model.generate(torch.tensor(prompt[None]), max_new_tokens=k,
                                   do_sample=False,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
                                   )[0, len(prompt):].tolist()
                    for prompt, k in zip(prompts, limits)]

    folder, expected = _shared(tmp_path_factory, f"generate-{batching}", build)
    comm = MPI.COMM_WORLD
    for dp, pp, tp, ep, m in GENERATE_EP[comm.Get_size()]:
        batch = ["generate.batch_size=2"] if batching == "continuous" else []
        result = run_generation(comm, load_job(None, [
            f"model.checkpoint='{folder}/model.h5'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.micro_batches={m}",
            "generate.max_new_tokens=20", "generate.stop_at_eos=false",
            f"generate.batching='{batching}'", *batch]),
            prompts=Prompts(prompts, max_new_tokens=limits), progress=False)
        if comm.Get_rank() != 0:
            continue
        assert result.lengths.tolist() == limits
        for b, (want, k) in enumerate(zip(expected, limits)):
            assert result.tokens[b, :k].tolist() == want, (b, dp, ep)


# ---- bad input -----------------------------------------------------------------------------

def _one_error(proc, words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and words in lines[0], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("ranks, family, args, words", [
    (2, "mixtral", ["train", "--dp", "2", "--ep", "2"], "ep 2 does not divide the 3 experts"),
    (2, "qwen2_moe", ["score", "--dp", "1", "--tp", "2", "--ep", "2"],
     "ep 2 does not divide dp 1"),
    (2, "gqa-llama3", ["generate", "--prompts", "random", "--max-new-tokens", "2", "--dp", "2",
                       "--ep", "2"],
     "ep 2 splits a mixture of experts' experts, but llama has none"),
    (2, "qwen2_moe", ["train", "--pp", "2", "--aux-loss-coef", "0.01"],
     "aux_loss_coef 0.01 with pp 2"),
    (1, "gqa-llama3", ["train", "--aux-loss-coef", "0.01"],
     "the router's load-balancing loss belongs to a mixture of experts"),
    (1, "deepseek_v3", ["train", "--aux-loss-coef", "0.01"],
     "transformers' deepseek_v3 has none for its router"),
])
def test_a_layout_or_setting_moe_cannot_run_is_one_error_before_any_work(
        tmp_path, ranks, family, args, words):
    changes = {"num_local_experts": 3} if family == "mixtral" else {}
    build_hf_model(family, tmp_path, **changes)
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 250, (8, 9)))
    data = ["--data", "data.npy"] if args[0] != "generate" else []
    out = "run" if args[0] == "train" else "out.h5"
    proc, _ = mpirun(ranks, ["-m", "hpcpar", args[0], "--checkpoint", "model.h5", *data,
                             "--out", out, *args[1:]], tmp_path)
    _one_error(proc, words)
    assert not (tmp_path / out).exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage, words", [
    ("missing", "tensor(s) the config needs are missing, first "
                "model.layers.1.mlp.experts.2.down_proj.weight"),
    ("misshapen", "model.layers.0.mlp.experts.1.up_proj.weight"),
    ("grouped router", "n_group 4: a router with grouped, biased or scaled top-k"),
])
def test_a_damaged_moe_checkpoint_or_another_router_is_refused_at_conversion(
        tmp_path, damage, words):
    from safetensors.numpy import load_file, save_file
    build_hf_model("qwen2_moe", tmp_path)
    hf = tmp_path / "hf"
    tensors = load_file(hf / "model.safetensors")
    if damage == "missing":
        del tensors["model.layers.1.mlp.experts.2.down_proj.weight"]
    elif damage == "misshapen":
        name = "model.layers.0.mlp.experts.1.up_proj.weight"
        tensors[name] = tensors[name][:-1]
    else:
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps(config | {"n_group": 4, "topk_group": 2}))
    save_file(tensors, hf / "model.safetensors")
    before = {p: p.read_bytes() for p in hf.iterdir()}
    proc, _ = mpirun(1, ["-m", "hpcpar", "convert", "hf", "new.h5"], tmp_path)
    _one_error(proc, words)
    assert not (tmp_path / "new.h5").exists() and not list(tmp_path.glob("new.h5*"))
    assert {p: p.read_bytes() for p in hf.iterdir()} == before
    shutil.rmtree(hf)
