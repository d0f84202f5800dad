"""Training under every schedule and layout reproduces the single-rank run: the loss of every
step, and the weights and optimizer state of the checkpoint written at the end. The layouts
are keyed by world size (mpiexec -n 2, 4 and 8); the other tests run at the one world size
that shows their point. Also: a run resumed under another layout ends where the straight run
ends, and the tp 2 stage passes a finite-difference check of its own."""


from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import (GEMMA, GQA, MISTRAL, PHI3, QWEN3, TIED, WORLD_SIZES, link_into, losses,
                     made_once, make_checkpoint, realistic_tensors)
from hpcpar.jobs.job import load_job
from hpcpar.jobs.train.engine import run_training

# (dp, pp, tp, micro_batches, schedule, virtual_stages), by world size
LAYOUTS = {
    2: [(1, 1, 2, 2, "1f1b", 1), (1, 2, 1, 4, "gpipe", 1), (2, 1, 1, 2, "1f1b", 1),
        (1, 2, 1, 4, "zb-h1", 1), (1, 2, 1, 2, "interleaved", 2)],
    4: [(1, 2, 2, 4, "1f1b", 1), (2, 2, 1, 2, "zb-h1", 1), (1, 4, 1, 4, "interleaved", 2),
        (1, 1, 4, 1, "gpipe", 1), (2, 1, 2, 2, "gpipe", 1)],
    8: [(2, 2, 2, 2, "1f1b", 1), (1, 4, 2, 4, "zb-h1", 1), (1, 2, 4, 2, "interleaved", 2),
        (4, 2, 1, 1, "gpipe", 1), (1, 8, 1, 8, "1f1b", 1)],
}
CONFIGS = {"gqa": dict(GQA, num_hidden_layers=8), "tied": TIED, "qwen3": QWEN3, "gemma": GEMMA,
           "mistral": MISTRAL, "phi3": PHI3}
GLOBAL_BATCH, STEPS = 8, 2


def _fits(cfg, layout):
    dp, pp, tp, m, kind, V = layout
    kv, layers = cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    return (pp * V <= layers and (kind != "interleaved" or layers % (pp * V) == 0)
            and cfg["num_attention_heads"] % tp == 0 and (kv % tp == 0 or tp % kv == 0))


def _shared_dir(tmp_path_factory, name):
    comm = MPI.COMM_WORLD
    folder = str(tmp_path_factory.mktemp(name)) if comm.Get_rank() == 0 else None
    return comm.bcast(folder, root=0)


def _made_once(tmp_path_factory, key, build):
    """A folder of this module's tests on every rank, holding links to what ``build`` made
    once for ``key`` in this run of the suite (on rank 0: the single-rank reference runs)."""
    comm = MPI.COMM_WORLD
    folder = _shared_dir(tmp_path_factory, key.replace(" ", "-"))
    if comm.Get_rank() == 0:
        link_into(Path(folder), made_once(f"test_train_mpi {key}", build))
    comm.Barrier()
    return folder


def made_setup(tmp_path_factory, name: str):
    """(config, folder) of CONFIGS[name]: a checkpoint, a dataset with left-padded rows, and
    the single-rank run, made once for every module that asks."""
    cfg = CONFIGS[name]

    def build(folder):
        make_checkpoint(folder, cfg)
        rng = np.random.default_rng(1)
        rows = rng.integers(0, cfg["vocab_size"], (24, 9))
        rows[3, :4] = -1                                  # left padding
        rows[10, :2] = -1
        np.save(f"{folder}/data.npy", rows)
        run_training(MPI.COMM_SELF, _job(folder, "single", (1, 1, 1, 1, "1f1b", 1)),
                     progress=False)

    return cfg, _made_once(tmp_path_factory, f"setup {name}", build)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def setup(request, tmp_path_factory):
    """A checkpoint, a dataset with left-padded rows, and the single-rank run."""
    return made_setup(tmp_path_factory, request.param)


def _job(folder, out, layout, *extra, optimizer="adamw"):
    """The training job of ``layout``. AdamW's eps is 1e-6: a gradient summed in another order
    differs by ~1e-9 absolute, and an element whose gradient is below eps moves by g / eps, so
    at eps 1e-8 one such element of a 64 x 64 tensor turned that 1e-9 into 1.3e-3 of the
    tensor's update (pp 8, measured); at 1e-6 the comparison is about the layout again."""
    dp, pp, tp, m, kind, V = layout
    sets = [f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/data.npy'",
            f"output.path='{folder}/{out}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.tp={tp}", f"parallel.micro_batches={m}", f"parallel.schedule='{kind}'",
            f"parallel.virtual_stages={V}", f"train.steps={STEPS}",
            f"train.global_batch={GLOBAL_BATCH}", f"train.optimizer='{optimizer}'",
            "train.lr=0.01", "train.weight_decay=0.1", "train.warmup_steps=1",
            "train.clip_grad=0.5", "train.peak_tflops=1.0", "train.eps=1e-6", *extra]
    return load_job(None, sets)


def assert_same_checkpoint(path, ref_path, before_path):
    """Weights and optimizer state: AdamW results compared by the update, normwise per tensor
    (docs/design.md §5), and the moments normwise too (float32 sums in another order)."""
    with h5py.File(path) as f, h5py.File(ref_path) as ref, h5py.File(before_path) as b:
        for name, dset in ref.items():
            if not isinstance(dset, h5py.Dataset):
                continue
            w, w_ref, w0 = f[name][()], dset[()], b[name][()].astype(np.float32)
            assert np.linalg.norm(w - w_ref) <= 1e-3 * np.linalg.norm(w_ref - w0) + 1e-7, name
        # the state of every tensor the optimizer updates (a fused tensor's parts each)
        assert set(f["optimizer"]) == set(ref["optimizer"])
        for name, states in ref["optimizer"].items():
            for state in ("exp_avg", "exp_avg_sq"):
                s, s_ref = f["optimizer"][name][state][()], states[state][()]
                assert np.linalg.norm(s - s_ref) <= 1e-3 * np.linalg.norm(s_ref), (name, state)
        assert dict(f["train"].attrs)["step"] == dict(ref["train"].attrs)["step"]


def assert_matches_single(folder, out, what=""):
    """The run in folder/out logged the single-rank run's losses and wrote its checkpoint."""
    np.testing.assert_allclose(losses(f"{folder}/{out}"), losses(f"{folder}/single"),
                               rtol=1e-5, err_msg=what)
    assert_same_checkpoint(f"{folder}/{out}/step-{STEPS}.h5", f"{folder}/single/step-{STEPS}.h5",
                           f"{folder}/model.h5")


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
def test_every_schedule_and_layout_reproduces_the_single_rank_steps(setup):
    comm = MPI.COMM_WORLD
    cfg, folder = setup
    layouts = [lay for lay in LAYOUTS[comm.Get_size()] if _fits(cfg, lay)]
    assert layouts
    for i, layout in enumerate(layouts):
        out = f"layout{comm.Get_size()}-{i}"
        run_training(comm, _job(folder, out, layout), progress=False)
        if comm.Get_rank() == 0:
            assert_matches_single(folder, out, str(layout))
        comm.Barrier()


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))               # dp 2 x pp 2
def test_many_buckets_overlap_the_backward_and_full_recompute_under_pp_and_dp(setup):
    """Buckets of 10 kB (several per stage and step, where the tests' models fit DDP's one 25 MB
    bucket) and --recompute full, with dp 2 and pp = the rest: the single-rank steps, and
    buckets reduced while the backward still runs."""
    comm = MPI.COMM_WORLD
    cfg, folder = setup
    pp = comm.Get_size() // 2
    layout = (2, pp, 1, 4 if pp > 1 else 2, "1f1b", 1)
    out = f"buckets-{comm.Get_size()}"
    report = run_training(comm, _job(folder, out, layout, "train.bucket_mb=0.01",
                                     "train.recompute='full'"), progress=False)
    if comm.Get_rank() == 0:
        assert_matches_single(folder, out, str(layout))
        # buckets are cut between layers: more than one per rank and step on average
        assert report.dp_buckets > STEPS * comm.Get_size(), report.dp_buckets
        assert report.dp_buckets_early > 0, report.dp_overlap
    comm.Barrier()


@pytest.mark.device
@pytest.mark.mpi(ranks=(8,))               # dp 2 x pp 2 x tp 2
def test_sgd_steps_agree_elementwise_across_layouts(setup):
    comm = MPI.COMM_WORLD
    cfg, folder = setup
    layout = [lay for lay in LAYOUTS[min(comm.Get_size(), 8)] if _fits(cfg, lay)][0]
    single = f"sgd-single-{comm.Get_size()}"
    if comm.Get_rank() == 0:
        run_training(MPI.COMM_SELF, _job(folder, single, (1, 1, 1, 1, "1f1b", 1),
                                         "train.momentum=0.9", optimizer="sgd"), progress=False)
    run_training(comm, _job(folder, f"sgd-{comm.Get_size()}", layout, "train.momentum=0.9",
                            optimizer="sgd"), progress=False)
    if comm.Get_rank() == 0:
        with h5py.File(f"{folder}/{single}/step-{STEPS}.h5") as ref, \
                h5py.File(f"{folder}/sgd-{comm.Get_size()}/step-{STEPS}.h5") as got:
            for name, dset in ref.items():
                if isinstance(dset, h5py.Dataset):
                    np.testing.assert_allclose(got[name][()], dset[()], rtol=1e-5, atol=1e-7)
    comm.Barrier()


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))               # tp 4 (or dp 4) -> pp 2 x tp 2 (or dp 2)
def test_a_run_resumed_under_another_layout_ends_with_the_same_weights(setup):
    comm = MPI.COMM_WORLD
    cfg, folder = setup
    n = comm.Get_size()
    out = f"resume-{n}"
    first = (1, 1, n, 1, "1f1b", 1) if _fits(cfg, (1, 1, n, 1, "1f1b", 1)) else (n, 1, 1, 1,
                                                                                 "1f1b", 1)
    second = (1, 2, n // 2, 2, "zb-h1", 1) if _fits(cfg, (1, 2, n // 2, 2, "zb-h1", 1)) \
        else (n // 2, 2, 1, 2, "zb-h1", 1)
    run_training(comm, _job(folder, out, first, "train.steps=1"), progress=False)
    run_training(comm, _job(folder, out, second, "train.resume='auto'"), progress=False)
    if comm.Get_rank() == 0:
        assert open(f"{folder}/{out}/latest").read().strip() == f"step-{STEPS}.h5"
        assert_matches_single(folder, out)
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_tp2_stage_gradients_pass_finite_differences_and_equal_tp1():
    from test_train_grads import CONFIGS as GRAD_CONFIGS, batch_of, build_chunk, directional
    from hpcpar.parallel.comm import create_communicator
    from hpcpar.models.sharding import merge, piece_of
    from hpcpar.jobs.train.grads import sum_replicated
    from hpcpar.jobs.train.params import GradSink

    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if sub == MPI.COMM_NULL:
        return
    tp = create_communicator(sub, "mpi", name="tp")
    for name in ("gqa", "tied"):      # tied: one KV head, replicated on both ranks
        cfg = GRAD_CONFIGS[name]
        tensors = {k: v.astype(np.float64) for k, v in realistic_tensors(cfg, 0).items()}
        rows = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, 6))
        batch = batch_of(rows, pad=[0, 2])
        single, single_params = build_chunk(cfg, tensors, create_communicator(MPI.COMM_SELF))
        loss1, ctx = single.forward(None, batch)
        single.backward(ctx, None, GradSink(np))
        chunk, params = build_chunk(cfg, tensors, tp)
        loss2, ctx = chunk.forward(None, batch)
        chunk.backward(ctx, None, GradSink(np))
        kv = tp if cfg["num_key_value_heads"] < 2 else None
        sum_replicated(list(params.values()), kv, None, np)
        assert float(loss2) == pytest.approx(float(loss1), rel=1e-12)
        rng = np.random.default_rng(5)
        for tname, p in params.items():
            gathered = np.empty((2,) + p.grad.shape)
            sub.Allgather(np.ascontiguousarray(p.grad), gathered)
            full = merge(list(gathered), p.spec, chunk.cfg)
            np.testing.assert_allclose(full, single_params[tname].grad, rtol=1e-9, atol=1e-12)
            # the parallel loss itself, along a direction shared by both ranks
            d_full = rng.standard_normal(p.spec.shape)
            shard = piece_of(p.spec, chunk.cfg, tp.rank, 2)
            d = np.zeros_like(p.data)
            d[shard.dest] = d_full[shard.source]

            def loss():
                return float(chunk.forward(None, batch)[0])

            fd = directional(loss, p.data, d)
            analytic = np.array([float((p.grad * d).sum()) if p.counted else 0.0])
            sub.Allreduce(MPI.IN_PLACE, analytic)
            assert fd == pytest.approx(analytic[0], rel=1e-6, abs=1e-9), tname
    sub.Free()


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))               # ZeRO over dp 4, and dp 2 beside tp or pp
def test_every_zero_stage_steps_and_saves_as_the_single_rank_run(setup):
    """ZeRO-1 over every rank as dp; ZeRO-3 (weights gathered layer by layer, recomputed in
    the backward) and ZeRO-2 over dp 2 beside tp or pp (interleaved where the model's
    layers allow), under other schedules; a ZeRO-3 run
    resumed under ZeRO-1 on another layout, and the other way round (ZeRO-3 reading its
    pieces of the weights and state alone), ends where the straight run ends. For the tied
    model also in bfloat16, whose gathers move the 16-bit copy of the float32 pieces."""
    comm = MPI.COMM_WORLD
    cfg, folder = setup
    n = comm.Get_size()
    mixed = [lay for lay in [(2, 1, n // 2, 2, "1f1b", 1), (2, n // 2, 1, 2, "zb-h1", 1)]
             if _fits(cfg, lay)]
    others = [lay for lay in [(2, n // 2, 1, 4, "interleaved", 2), (2, 1, n // 2, 2, "gpipe", 1)]
              if _fits(cfg, lay) and (lay[1] > 1 or lay[4] != "interleaved")]
    runs = [((n, 1, 1, 1, "1f1b", 1), ["train.zero=1"]),
            (mixed[0], ["train.zero=3", "train.recompute='full'"]),
            (others[0], ["train.zero=2"])]
    for i, (layout, extra) in enumerate(runs):
        out = f"zero{n}-{i}"
        run_training(comm, _job(folder, out, layout, *extra), progress=False)
        if comm.Get_rank() == 0:
            assert_matches_single(folder, out, f"{layout} {extra}")
        comm.Barrier()
    for first, then in ((3, 1), (1, 3)):
        out = f"zero-resume{n}-{first}"
        run_training(comm, _job(folder, out, mixed[0], f"train.zero={first}", "train.steps=1"),
                     progress=False)
        run_training(comm, _job(folder, out, (n, 1, 1, 1, "gpipe", 1), f"train.zero={then}",
                                "train.resume='auto'"), progress=False)
        if comm.Get_rank() == 0:
            assert_matches_single(folder, out, f"zero {first} then {then}")
        comm.Barrier()
    if cfg is TIED:
        _bfloat16_under_zero3(comm, folder)


def _bfloat16_under_zero3(comm, folder):
    """dp 2 x pp 2 (on 4 ranks) under ZeRO-3 in bfloat16 against the single rank in
    bfloat16, with SGD:
    AdamW's normalised step would turn the rounding noise of a gradient that is zero in exact
    arithmetic (a key bias: softmax ignores it) into whole steps."""
    bf16 = "model.dtype='bfloat16'"
    if comm.Get_rank() == 0:
        run_training(MPI.COMM_SELF, _job(folder, "single-bf16", (1, 1, 1, 1, "1f1b", 1), bf16,
                                         optimizer="sgd"), progress=False)
    comm.Barrier()
    layout = (2, comm.Get_size() // 2, 1, 2, "1f1b", 1)
    run_training(comm, _job(folder, "zero3-bf16", layout, "train.zero=3", bf16, optimizer="sgd"),
                 progress=False)
    if comm.Get_rank() == 0:
        np.testing.assert_allclose(losses(f"{folder}/zero3-bf16"),
                                   losses(f"{folder}/single-bf16"), rtol=1e-3)
        with h5py.File(f"{folder}/zero3-bf16/step-{STEPS}.h5") as f, \
                h5py.File(f"{folder}/single-bf16/step-{STEPS}.h5") as ref, \
                h5py.File(f"{folder}/model.h5") as before:
            for name, dset in ref.items():
                if isinstance(dset, h5py.Dataset):
                    w, w_ref = f[name][()], dset[()]
                    update = w_ref - before[name][()].astype(np.float32)
                    assert w.dtype == np.float32, name
                    assert np.linalg.norm(w - w_ref) <= 0.05 * np.linalg.norm(update) + 1e-7, name
    comm.Barrier()


# ---- context parallelism: sequences longer than one tile, split over cp ------------------

# (dp, pp, cp, tp, micro_batches, schedule, virtual_stages), by world size
CP_LAYOUTS = {
    2: [(1, 1, 2, 1, 1, "1f1b", 1)],
    4: [(1, 1, 4, 1, 1, "1f1b", 1), (1, 2, 2, 1, 2, "1f1b", 1), (2, 1, 2, 1, 1, "gpipe", 1),
        (1, 1, 2, 2, 2, "1f1b", 1)],
    8: [(1, 1, 8, 1, 1, "1f1b", 1), (2, 2, 2, 1, 2, "zb-h1", 1), (1, 2, 2, 2, 2, "interleaved", 2),
        (2, 1, 2, 2, 1, "gpipe", 1)],
}
CP_CONFIGS = {"gqa": dict(GQA, num_hidden_layers=4, max_position_embeddings=256),
              "mistral": dict(MISTRAL, max_position_embeddings=256)}


@pytest.fixture(scope="module", params=sorted(CP_CONFIGS))
def long_setup(request, tmp_path_factory):
    """Rows of 141 tokens (140 positions: longer than one 128-position tile, not divisible
    by 3 or 8, nor into 2 cp chunks per rank evenly at cp 8), two of them left-padded, and
    the single-rank run."""
    cfg = CP_CONFIGS[request.param]

    def build(folder):
        make_checkpoint(folder, cfg)
        rng = np.random.default_rng(2)
        rows = rng.integers(0, cfg["vocab_size"], (8, 141))
        rows[3, :50] = -1
        rows[6, :137] = -1                     # 3 real positions: fewer than the cp chunks
        np.save(f"{folder}/data.npy", rows)
        run_training(MPI.COMM_SELF, _job(folder, "single", (1, 1, 1, 1, "1f1b", 1)),
                     progress=False)

    return cfg, _made_once(tmp_path_factory, f"long_setup {request.param}", build)


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the cp layouts of each world size
def test_context_parallel_layouts_reproduce_the_single_rank_steps(long_setup):
    """cp alone and with dp (and ZeRO-1), pp under every kind of schedule, and tp: the
    single rank's losses, weights and optimizer state."""
    comm = MPI.COMM_WORLD
    cfg, folder = long_setup
    for i, (dp, pp, cp, tp, m, kind, V) in enumerate(CP_LAYOUTS[comm.Get_size()]):
        out = f"cp{comm.Get_size()}-{i}"
        # ZeRO over dp x cp: stage 3 under gpipe, 1 under zb-h1
        zero = {"gpipe": 3, "zb-h1": 1}.get(kind, 0) if dp > 1 else 0
        extra = [f"parallel.cp={cp}", f"train.zero={zero}"]
        run_training(comm, _job(folder, out, (dp, pp, tp, m, kind, V), *extra), progress=False)
        if comm.Get_rank() == 0:
            assert_matches_single(folder, out, str((dp, pp, cp, tp, m, kind, V)))
        comm.Barrier()


@pytest.mark.mpi(ranks=(4,))               # 140 positions in 8 chunks: uneven
def test_plan_predicts_the_activations_each_cp_rank_keeps(long_setup):
    """cp over the whole world: each rank's peak activation bytes, measured by the run, are
    ``plan``'s formula at its own positions per row (the plan prints the largest). NumPy
    arrays: the formula counts theirs (the strict backend's wrappers keep other views)."""
    from hpcpar.models.config import ModelConfig
    from hpcpar.parallel.context_parallel.ring_attention import ContextShard
    from hpcpar.jobs.train.memory import activation_bytes
    comm = MPI.COMM_WORLD
    cfg, folder = long_setup
    n = comm.Get_size()
    report = run_training(comm, _job(folder, f"cp-plan{n}", (1, 1, 1, 1, "1f1b", 1),
                                     f"parallel.cp={n}", "parallel.backend='numpy'"),
                          progress=False)
    if comm.Get_rank() == 0:
        model = ModelConfig.from_hf(cfg)
        for r in range(n):
            here = ContextShard(140, n, r).local_length()
            planned = activation_bytes(model, 1, cfg["num_hidden_layers"], GLOBAL_BATCH, here,
                                       True, True, False)
            assert report.peak_activation_mb[r] == pytest.approx(planned / 1e6, rel=1e-9), r
    comm.Barrier()
