"""Megatron's sequence parallelism (``--sequence-parallel``): the library's layers with their
activations split along the sequence against the dense computation (forward and every
gradient); training under tp 2, pp 2 x tp 2 (zero-bubble), cp 2 x tp 2 (recompute, ZeRO-3) and
mixtures of experts (tp 2, dp 2 x ep 2 x tp 2 under ZeRO-3, with the load-balancing loss; a
shared expert's gate) against the single rank: losses, gradient norms, weights and optimizer
state after 2 steps with micro-batches and clipping; generation's and scoring's prefill
against the single rank's tokens, logits and log-probabilities. The activation bytes each
rank keeps are ``plan``'s formula. Bad input is one line before any work."""

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from helpers import hpcpar_here
from test_moe import moe_training  # noqa: F401  (its Qwen3-MoE run, made once)
from test_train_mpi import STEPS, _job, _made_once, assert_matches_single, made_setup
from hpcpar.jobs.train.engine import run_training

SP = "parallel.sequence_parallel=true"
# (dp, pp, tp, micro_batches, schedule, virtual_stages, extra settings), by world size
LAYOUTS = {
    2: [(1, 1, 2, 2, "1f1b", 1, ("parallel.backend='numpy'",))],
    4: [(1, 2, 2, 4, "zb-h1", 1, ()),
        (1, 1, 2, 2, "1f1b", 1, ("parallel.cp=2", "train.recompute='full'", "train.zero=3"))],
}
# (dp, pp, tp, ep, micro_batches, schedule, zero stage) of test_moe's Qwen3-MoE run
MOE_LAYOUTS = {2: [(1, 1, 2, 1, 4, "1f1b", 0)], 4: [(2, 1, 2, 2, 2, "gpipe", 3)]}


# ---- the library's layers --------------------------------------------------------------

def _mesh(comm):
    import hpcpar.parallel as hp
    return hp.Mesh(comm, {"tp": comm.Get_size()})


def _mine(a, tp, axis=1):
    """This rank's equal share of ``a`` along ``axis``."""
    n = a.shape[axis] // tp.size
    return np.take(a, range(tp.rank * n, (tp.rank + 1) * n), axis=axis)


@pytest.mark.mpi(min_size=2)
def test_a_column_row_pair_on_split_positions_is_the_dense_pair(comm):
    """Y = (X A^T + a) B^T + b over X split along the sequence: each rank's positions of Y,
    of dX, and its slices of dA, da, dB (whole), db (whole) are the dense computation's."""
    import hpcpar.parallel as hp
    tp = _mesh(comm).group("tp")
    rng = np.random.default_rng(0)
    B, T, h, inner = 2, 4 * tp.size, 6, 4 * tp.size
    x, dy = rng.standard_normal((B, T, h)), rng.standard_normal((B, T, h))
    A, a = rng.standard_normal((inner, h)), rng.standard_normal(inner)
    W, b = rng.standard_normal((h, inner)), rng.standard_normal(h)
    col = hp.ColumnParallelLinear.from_full(tp, A, a, sequence_axis=1)
    row = hp.RowParallelLinear.from_full(tp, W, b, sequence_axis=1)
    z, ctx1 = col.forward(_mine(x, tp))
    y, ctx2 = row.forward(z)
    dx = col.backward(row.backward(_mine(dy, tp), ctx2), ctx1)
    ref_z = x @ A.T + a                                   # the dense pair, float64
    np.testing.assert_allclose(y, _mine(ref_z @ W.T + b, tp), rtol=1e-12)
    dz = dy @ W
    np.testing.assert_allclose(dx, _mine(dz @ A, tp), rtol=1e-12)
    cols = _mine(np.arange(inner), tp, axis=0)
    np.testing.assert_allclose(row.weight.grad, np.einsum("bth,bti->hi", dy, ref_z)[:, cols])
    np.testing.assert_allclose(row.bias.grad, dy.sum(axis=(0, 1)))
    np.testing.assert_allclose(col.weight.grad, np.einsum("bti,bth->ih", dz, x)[cols])
    np.testing.assert_allclose(col.bias.grad, dz.sum(axis=(0, 1))[cols])
    # rows of (positions, features) given with the sequence on axis 1, the features' axis
    with pytest.raises(hp.HpcparError, match="sequence_axis 1 is not a positions axis"):
        col.forward(_mine(x, tp)[0])


@pytest.mark.mpi(min_size=2)
def test_the_embedding_and_head_on_split_positions_are_the_dense_ones(comm):
    """The vocab-parallel embedding leaves each rank its positions (a ReduceScatter), the
    head reads them gathered: outputs and gradients are the dense lookup's and product's."""
    import hpcpar.parallel as hp
    tp = _mesh(comm).group("tp")
    rng = np.random.default_rng(1)
    V, h, B, T = 11, 6, 2, 2 * tp.size
    E, H = rng.standard_normal((V, h)), rng.standard_normal((V, h))
    ids = rng.integers(0, V, (B, T))
    emb = hp.VocabParallelEmbedding.from_full(tp, E, sequence_axis=1)
    head = hp.ParallelLMHead.from_full(tp, H, sequence_axis=1)
    x, ectx = emb.forward(ids)
    np.testing.assert_allclose(x, _mine(E[ids], tp))
    logits = head.local_logits(x)                         # every position, own vocab block
    rows = range(head.start, head.stop)
    np.testing.assert_allclose(logits[..., :len(rows)], (E[ids] @ H.T)[..., rows])
    dlogits = rng.standard_normal((B, T, V))
    mine = np.zeros(logits.shape)
    mine[..., :len(rows)] = dlogits[..., rows]
    dx = head.backward(mine, x)
    np.testing.assert_allclose(dx, _mine(dlogits @ H, tp))
    emb.backward(dx, ectx)
    dE = np.zeros_like(E)
    np.add.at(dE, ids, dlogits @ H)
    np.testing.assert_allclose(emb.weight.grad[:len(rows)], dE[rows])


@pytest.mark.mpi(min_size=2)
def test_a_moe_layer_on_split_positions_is_the_dense_computation(comm):
    """Every tp rank routes every token (gathered), each rank's positions of y and dx and
    its gradients are the dense torch layer's."""
    import hpcpar.parallel as hp
    from test_moe import TOP_K, _check_grads, _layer, _torch_moe
    tp = _mesh(comm).group("tp")
    weights = _layer()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3 * tp.size, weights[0].shape[1]))
    dy = rng.standard_normal(x.shape)
    moe = hp.MoE.from_full(*weights, TOP_K, True, tp=tp, sequence_axis=1)
    y, ctx = moe.forward(_mine(x, tp), train=True)
    dx = moe.backward(_mine(dy, tp), ctx)
    ref_y, ref_dx, ref_grads = _torch_moe(weights, x.reshape(-1, x.shape[-1]),
                                          dy.reshape(-1, x.shape[-1]), True)
    np.testing.assert_allclose(y, _mine(ref_y.reshape(x.shape), tp), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, _mine(ref_dx.reshape(x.shape), tp), rtol=1e-5, atol=1e-6)
    inter = weights[1].shape[1]
    _check_grads(moe, ref_grads, range(weights[0].shape[0]),
                 slice(tp.rank * inter // tp.size, (tp.rank + 1) * inter // tp.size))


# ---- training against the single rank -------------------------------------------------

@pytest.fixture(scope="module", params=["gemma", "qwen3", "tied"])
def sp_setup(request, tmp_path_factory):
    """test_train_mpi's ``setup`` of a few of its models (the same folder, made once): a
    tied head with biases and one KV head (tied), per-head q/k norms (qwen3), Gemma's
    (1 + w) norms and embedding scale; rows of 8 positions, two left-padded."""
    return made_setup(tmp_path_factory, request.param)


def _grad_norms(folder):
    return [json.loads(line)["grad_norm"] for line in open(Path(folder) / "metrics.jsonl")]


@pytest.mark.mpi(ranks=(2, 4))
def test_sequence_parallel_layouts_reproduce_the_single_rank_steps(sp_setup):
    """tp 2 (and the activation bytes of each rank: plan's formula, split), pp 2 x tp 2
    under zero-bubble with its deferred weight gradients, cp 2 x tp 2 with recompute and
    ZeRO-3 (over the cp ranks, which hold the same weights)."""
    from hpcpar.jobs.train.memory import activation_bytes
    from hpcpar.models.config import ModelConfig
    comm = MPI.COMM_WORLD
    cfg, folder = sp_setup
    for i, (dp, pp, tp, m, kind, V, extra) in enumerate(LAYOUTS[comm.Get_size()]):
        out = f"sp{comm.Get_size()}-{i}"
        report = run_training(comm, _job(folder, out, (dp, pp, tp, m, kind, V), SP, *extra),
                              progress=False)
        if comm.Get_rank() == 0:
            assert_matches_single(folder, out, str((dp, pp, tp, m, kind, V, extra)))
            np.testing.assert_allclose(_grad_norms(f"{folder}/{out}"),
                                       _grad_norms(f"{folder}/single"), rtol=1e-5)
            if "parallel.backend='numpy'" in extra:      # the formula counts NumPy's arrays
                planned = activation_bytes(ModelConfig.from_hf(cfg), tp,
                                           cfg["num_hidden_layers"], 8 // m, 8, True, True,
                                           False, sequence_parallel=True)
                unsplit = activation_bytes(ModelConfig.from_hf(cfg), tp,
                                           cfg["num_hidden_layers"], 8 // m, 8, True, True,
                                           False)
                assert planned < unsplit
                assert report.peak_activation_mb == pytest.approx([planned / 1e6] * tp,
                                                                  rel=1e-9)
        comm.Barrier()


@pytest.mark.mpi(ranks=(2, 4))
def test_a_mixture_of_experts_under_sequence_parallelism_is_the_single_rank(moe_training):
    """Qwen3-MoE (a dense layer between routed ones) with the load-balancing loss: tp 2, and
    dp 2 x ep 2 x tp 2 under ZeRO-3: losses, gradient norms, the experts' loads, the aux
    loss, weights."""
    from test_moe import _train_job
    from test_train_mpi import assert_same_checkpoint
    comm = MPI.COMM_WORLD
    folder = moe_training
    for i, layout in enumerate(MOE_LAYOUTS[comm.Get_size()]):
        out = f"sp-moe{comm.Get_size()}-{i}"
        run_training(comm, _train_job(folder, out, layout, STEPS, SP), progress=False)
        if comm.Get_rank() == 0:
            single = f"{folder}/single-aux"
            metrics = [json.loads(line) for line in open(f"{folder}/{out}/metrics.jsonl")]
            ref = [json.loads(line) for line in open(f"{single}/metrics.jsonl")]
            for key in ("loss", "grad_norm", "aux_loss"):
                assert [m[key] for m in metrics] == pytest.approx([r[key] for r in ref],
                                                                  rel=1e-5), key
            assert [m["expert_load"] for m in metrics] == [r["expert_load"] for r in ref]
            assert_same_checkpoint(f"{folder}/{out}/step-2.h5", f"{single}/step-2.h5",
                                   f"{folder}/model.h5")
        comm.Barrier()


@pytest.fixture(scope="module")
def shared_expert(tmp_path_factory):
    """Qwen2-MoE (a shared expert added through its sigmoid gate, whose weight reads the
    split positions), rows with left padding, and its single-rank run with the
    load-balancing loss (test_moe's settings)."""
    from helpers import build_hf_model
    from test_moe import SINGLE_MICRO_BATCHES, _train_job

    def build(folder):
        build_hf_model("qwen2_moe", Path(folder))
        rows = np.random.default_rng(1).integers(0, 250, (24, 9))
        rows[3, :4] = -1
        np.save(f"{folder}/data.npy", rows)
        run_training(MPI.COMM_SELF, _train_job(
            folder, "single-aux", (1, 1, 1, 1, SINGLE_MICRO_BATCHES, "1f1b", 0)), progress=False)

    return _made_once(tmp_path_factory, "test_sequence_parallel qwen2_moe", build)


@pytest.mark.mpi(ranks=(2,))
def test_a_shared_experts_gate_under_sequence_parallelism_is_the_single_rank(shared_expert):
    from test_moe import _train_job
    from test_train_mpi import assert_same_checkpoint
    comm = MPI.COMM_WORLD
    folder = shared_expert
    run_training(comm, _train_job(folder, "sp", (1, 1, 2, 1, 4, "1f1b", 0), STEPS, SP),
                 progress=False)
    if comm.Get_rank() == 0:
        for key in ("loss", "grad_norm", "aux_loss"):
            mine, ref = (np.array([json.loads(line)[key] for line in open(f"{folder}/{out}/"
                                                                          "metrics.jsonl")])
                         for out in ("sp", "single-aux"))
            np.testing.assert_allclose(mine, ref, rtol=1e-5, err_msg=key)
        assert_same_checkpoint(f"{folder}/sp/step-2.h5", f"{folder}/single-aux/step-2.h5",
                               f"{folder}/model.h5")
    comm.Barrier()


def test_plan_counts_the_split_activations(tmp_path):
    """``plan --train --sequence-parallel`` prints the layout's split and, per stage, the
    activations of ``activation_bytes`` with it (what the tp 2 run above measures)."""
    from hpcpar.checkpoint import preset_config
    from hpcpar.jobs.train.memory import activation_bytes
    from hpcpar.models.config import ModelConfig
    args = ["plan", "--preset", "llama3-8b", "--train", "--tp", "4", "--world", "4",
            "--seq-len", "4096", "--global-batch", "1"]
    whole, split = (hpcpar_here(args + more, tmp_path) for more in ([], ["--sequence-parallel"]))
    assert whole.returncode == split.returncode == 0, whole.stderr + split.stderr
    assert "sequence parallel over tp 4" in split.stdout
    cfg = ModelConfig.from_hf(preset_config("llama3-8b"))
    for done, sp in ((whole, False), (split, True)):
        planned = activation_bytes(cfg, 4, 32, 1, 4096, True, True, False, sequence_parallel=sp)
        assert f"{planned / 1e9:.2f} GB" in done.stdout.splitlines()[4], done.stdout


# ---- generation's and scoring's prefill --------------------------------------------------

@pytest.mark.mpi(ranks=(2,))
def test_a_sequence_parallel_prefill_generates_and_scores_as_the_single_rank(
        tmp_path_factory, monkeypatch):
    """tp 2 with the prefill split over tp (prompts padded to 12 positions; scored rows of
    8): the single rank's tokens and prompt logits, static and continuous batching, and its
    log-probabilities; the split pass ran (decode steps keep the whole path)."""
    import h5py
    from helpers import GQA, PROMPTS, world_checkpoint
    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.score.engine import run_scoring
    from hpcpar.models.decoder import DecoderStage
    comm = MPI.COMM_WORLD
    folder = world_checkpoint(tmp_path_factory, "sp-generate", GQA)
    split = []
    original = DecoderStage._split_forward
    monkeypatch.setattr(DecoderStage, "_split_forward",
                        lambda self, *a: split.append(a[0].shape) or original(self, *a))
    if comm.Get_rank() == 0:
        np.save(folder / "rows.npy", np.random.default_rng(3).integers(0, 250, (6, 8)))
    comm.Barrier()

    def job(out, *sets):
        return load_job(None, [f"model.checkpoint='{folder}/model.h5'", f"output.path='{out}'",
                               "generate.max_new_tokens=5", "generate.stop_at_eos=false",
                               "generate.save_logits=true", f"score.data='{folder}/rows.npy'",
                               *sets])

    for kind, run in (("static", run_generation), ("continuous", run_generation),
                      ("score", run_scoring)):
        sets = [f"generate.batching='{kind}'"] if run is run_generation else []
        extra = {"prompts": Prompts(PROMPTS)} if run is run_generation else {}
        if comm.Get_rank() == 0:
            run(MPI.COMM_SELF, job(folder / f"{kind}-1.h5", *sets), progress=False, **extra)
        comm.Barrier()
        before = len(split)
        run(comm, job(folder / f"{kind}-sp.h5", *sets, "parallel.tp=2", SP), progress=False,
            **extra)
        assert len(split) > before, kind
        if comm.Get_rank() == 0:
            with h5py.File(folder / f"{kind}-1.h5") as a, h5py.File(folder / f"{kind}-sp.h5") as b:
                for name in ("tokens", "prompt_logits", "token_logprobs"):
                    if name in a:
                        np.testing.assert_allclose(b[name][()], a[name][()], atol=1e-5,
                                                   err_msg=f"{kind} {name}")
        comm.Barrier()


# ---- bad input --------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["train", "--data", "data.npy", "--steps", "1", "--global-batch", "4", "--out", "run"],
    ["generate", "--prompts", "data.npy", "--max-new-tokens", "2", "--out", "run"],
    ["score", "--data", "data.npy", "--out", "run"]], ids=lambda c: c[0])
def test_sequence_parallelism_without_tp_is_one_line_before_any_work(tmp_path, command):
    from helpers import GQA, make_checkpoint
    make_checkpoint(tmp_path, GQA)
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 250, (8, 9)))
    done = hpcpar_here([command[0], "--checkpoint", "model.h5", *command[1:],
                        "--sequence-parallel"], tmp_path)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("hpcpar: error:")]
    assert len(errors) == 1 and "give --tp 2 or more" in errors[0], done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cp, width, words", [
    (1, 8, "the 7 positions per row into tp 2"),
    (2, 11, "5 positions per cp rank (of 10) into tp 2")])
def test_positions_tp_does_not_divide_are_refused_naming_the_fix(tmp_path, cp, width, words):
    """Checked with the job, before any rank communicates (the CLI's exit 2)."""
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.train.setup import validate
    from hpcpar.parallel.errors import HpcparError
    from helpers import GQA, make_checkpoint
    make_checkpoint(tmp_path, GQA)
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 250, (8, width)))
    job = load_job(None, [f"model.checkpoint='{tmp_path}/model.h5'",
                          f"data.dataset='{tmp_path}/data.npy'", f"output.path='{tmp_path}/run'",
                          "parallel.tp=2", f"parallel.cp={cp}", "train.global_batch=4", SP])
    with pytest.raises(HpcparError, match="does not divide") as error:
        validate(job, open_checkpoint(tmp_path / "model.h5"), 2 * cp)
    assert words in str(error.value) and "--seq-len" in str(error.value)
    assert "\n" not in str(error.value)
