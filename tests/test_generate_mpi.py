"""Every layout reproduces the single-rank run: prompt logits (<= 1e-4, float32), greedy
tokens, and seeded samples. The layouts are keyed by world size, so the layout tests run
under mpiexec -n 2, 4 and 8 (8 ranks for the three-axis layouts); each layout runs on all
ranks, and rank 0 computes the single-rank reference (once a family and setting: the other
ranks would compute the same on the same two cores). What one rank alone shows (a seed
reproduces its tokens, a row's own seed keys its draws) is checked in the serial phase."""

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import (GEMMA, GQA, MISTRAL, PHI3, PROMPTS, QWEN3, TIED, WORLD_SIZES,
                     make_checkpoint, world_checkpoint)
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job

# (dp, pp, tp, micro_batches), keyed by world size
LAYOUTS = {
    2: [(1, 1, 2, 1), (1, 2, 1, 2), (2, 1, 1, 1)],
    4: [(1, 2, 2, 3), (2, 1, 2, 2), (1, 1, 4, 1), (1, 4, 1, 4), (2, 2, 1, 2)],
    8: [(1, 4, 2, 4), (2, 2, 2, 2), (1, 8, 1, 3), (1, 1, 8, 1), (4, 1, 2, 1)],
}
CONFIGS = {"gqa": GQA, "tied": TIED, "qwen3": QWEN3, "gemma": GEMMA, "mistral": MISTRAL,
           "phi3": PHI3}


def _fits(cfg, pp, tp):
    kv = cfg["num_key_value_heads"]
    return (pp <= cfg["num_hidden_layers"] and cfg["num_attention_heads"] % tp == 0
            and (kv % tp == 0 or tp % kv == 0))


def _layouts(comm, cfg):
    layouts = [lay for lay in LAYOUTS[comm.Get_size()] if _fits(cfg, lay[1], lay[2])]
    assert layouts, f"no layout to compare at {comm.Get_size()} ranks"
    return layouts


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    return cfg, f"{world_checkpoint(tmp_path_factory, request.param, cfg)}/model.h5"


def _generate(comm, path, layout=(1, 1, 1, 1), prompts=None, **gen):
    """A generation of ``prompts`` (default ``PROMPTS``) under ``layout`` on ``comm``."""
    dp, pp, tp, mbs = layout
    sets = [f"model.checkpoint='{path}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.tp={tp}", f"parallel.micro_batches={mbs}", "generate.max_new_tokens=6",
            "generate.save_logits=true", "generate.stop_at_eos=false"]
    sets += [f"generate.{k}={v}" for k, v in gen.items()]
    return run_generation(comm, load_job(None, sets), prompts=prompts or Prompts(PROMPTS),
                          progress=False)


_REFERENCES: dict = {}


def _single(path, prompts="PROMPTS", **gen):
    """The single-rank run of the module's prompt set ``prompts`` (a name: "PROMPTS" or
    "MIXED") with these settings, on rank 0 (None elsewhere), made once a run of the tests:
    several tests compare with the same one."""
    if MPI.COMM_WORLD.Get_rank() != 0:
        return None
    key = (path, prompts, tuple(sorted(gen.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = _generate(MPI.COMM_SELF, path, prompts=PROMPT_SETS[prompts], **gen)
    return _REFERENCES[key]


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
def test_every_layout_reproduces_the_single_rank_logits_and_greedy_tokens(checkpoint):
    comm = MPI.COMM_WORLD
    cfg, path = checkpoint
    single = _single(path)
    for layout in _layouts(comm, cfg):
        result = _generate(comm, path, layout)
        if comm.Get_rank() == 0:
            np.testing.assert_allclose(result.prompt_logits, single.prompt_logits, atol=1e-4,
                                       rtol=0, err_msg=f"layout {layout}")
            assert result.tokens.tolist() == single.tokens.tolist(), layout
        else:
            assert result is None


OWN_SAMPLING = [{}, {"temperature": 0.9, "top_k": 20, "seed": 5},
                {"temperature": 1.3, "top_p": 0.95, "seed": 2},          # the whole vocabulary
                {"temperature": 0.7, "top_k": 3, "top_p": 0.8, "seed": 9}]
# greedy rows, top-k rows, whole-vocabulary top-p rows and another seed in one batch
OWN = [OWN_SAMPLING[i % len(OWN_SAMPLING)] for i in range(2 * len(PROMPTS))]
PROMPT_SETS = {"PROMPTS": Prompts(PROMPTS), "MIXED": Prompts(PROMPTS * 2, sampling=OWN)}


@pytest.mark.device
def test_each_prompt_samples_with_its_own_settings_on_one_rank(checkpoint):
    """Each greedy row's tokens are those of a greedy job, each row with its own seed's those
    of the same lines alone (a line's own seed keys its draws wherever it is, as vLLM's
    per-request seed)."""
    cfg, path = checkpoint
    prompts = PROMPTS * 2
    single = _single(path, "MIXED")
    for settings in OWN_SAMPLING:
        rows = [i for i, o in enumerate(OWN) if o == settings]
        if "seed" in settings:
            alike = _generate(MPI.COMM_SELF, path, prompts=Prompts(
                [prompts[i] for i in rows], sampling=[settings] * len(rows)))
            assert single.tokens[rows].tolist() == alike.tokens.tolist(), settings
        else:
            alike = _generate(MPI.COMM_SELF, path, prompts=Prompts(prompts), **settings)
            assert single.tokens[rows].tolist() == alike.tokens[rows].tolist(), settings


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
def test_each_prompt_samples_with_its_own_settings_under_every_layout(checkpoint):
    """Rows that each sample with their own settings (``OWN``): every layout (static, or one
    row in flight) gives the single rank's tokens."""
    comm = MPI.COMM_WORLD
    cfg, path = checkpoint
    single = _single(path, "MIXED")
    for layout in _layouts(comm, cfg)[:2]:
        static = _generate(comm, path, layout, prompts=PROMPT_SETS["MIXED"],
                           batching="'static'")
        refilled = _generate(comm, path, layout, prompts=PROMPT_SETS["MIXED"], batch_size=1)
        if comm.Get_rank() == 0:
            assert static.tokens.tolist() == single.tokens.tolist(), layout
            assert refilled.tokens.tolist() == single.tokens.tolist(), layout


@pytest.mark.device
@pytest.mark.mpi(ranks=(4,))               # two uneven stages beside tp 2
def test_an_explicit_uneven_stage_split_gives_the_same_numbers(checkpoint):
    comm = MPI.COMM_WORLD
    cfg, path = checkpoint
    # two stages, the widest tp the model splits over, the rest data-parallel
    tp = max(t for t in (1, 2, 4) if comm.Get_size() % (2 * t) == 0 and _fits(cfg, 2, t))
    dp = comm.Get_size() // (2 * tp)
    single = _single(path)
    split = [cfg["num_hidden_layers"] - 1, 1]
    job = load_job(None, [f"model.checkpoint='{path}'", f"parallel.dp={dp}", "parallel.pp=2",
                          f"parallel.tp={tp}", f"parallel.stage_layers={split}",
                          "parallel.micro_batches=2", "generate.max_new_tokens=6",
                          "generate.save_logits=true", "generate.stop_at_eos=false"])
    uneven = run_generation(comm, job, prompts=Prompts(PROMPTS), progress=False)
    if comm.Get_rank() == 0:
        np.testing.assert_allclose(uneven.prompt_logits, single.prompt_logits, atol=1e-4, rtol=0)
        assert uneven.tokens.tolist() == single.tokens.tolist()


SAMPLING = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 5}
FULL_VOCAB = {"temperature": 1.3, "top_p": 0.95, "seed": 2}      # gathers the vocabulary


@pytest.mark.device
def test_seeded_sampling_is_reproducible_on_one_rank(checkpoint):
    cfg, path = checkpoint
    single = _single(path, **SAMPLING)
    again = _generate(MPI.COMM_SELF, path, **SAMPLING)
    other = _generate(MPI.COMM_SELF, path, **dict(SAMPLING, seed=6))
    assert single.tokens.tolist() == again.tokens.tolist()
    assert single.tokens.tolist() != other.tokens.tolist()
    static = _generate(MPI.COMM_SELF, path, **SAMPLING, batching="'static'")
    assert static.tokens.tolist() == single.tokens.tolist()    # draws keyed by prompt, token


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
def test_seeded_sampling_is_layout_independent(checkpoint):
    comm = MPI.COMM_WORLD
    cfg, path = checkpoint
    single, single_p = _single(path, **SAMPLING), _single(path, **FULL_VOCAB)
    for layout in _layouts(comm, cfg)[:2]:
        result = _generate(comm, path, layout, **SAMPLING)
        result_p = _generate(comm, path, layout, **FULL_VOCAB)
        refilled = _generate(comm, path, layout, **SAMPLING, batch_size=1)
        if comm.Get_rank() == 0:
            assert result.tokens.tolist() == single.tokens.tolist(), layout
            assert result_p.tokens.tolist() == single_p.tokens.tolist(), layout
            assert refilled.tokens.tolist() == single.tokens.tolist(), layout


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts, and cp over the whole world
def test_samples_and_their_logprobs_are_the_single_ranks_under_every_layout(checkpoint):
    """n 3 sampled with log-probs: a prompt's prefill shared by its samples (copied KV-cache
    rows on every stage, logits copied on the last) gives the single rank's tokens, and so
    does cp, where each sample prefills its own split cache."""
    comm = MPI.COMM_WORLD
    cfg, path = checkpoint
    sampling = {"temperature": 0.9, "top_k": 20, "seed": 5, "n": 3, "logprobs": 2}
    single = _single(path, **sampling)
    runs = {layout: _generate(comm, path, layout, **sampling)
            for layout in _layouts(comm, cfg)[:2]}
    if cfg is GQA:                               # cp: every rank one part of each prompt
        job = load_job(None, [f"model.checkpoint='{path}'", f"parallel.cp={comm.Get_size()}",
                              "generate.max_new_tokens=6", "generate.stop_at_eos=false",
                              *(f"generate.{k}={v}" for k, v in sampling.items())])
        runs["cp"] = run_generation(comm, job, prompts=Prompts(PROMPTS), progress=False)
    if comm.Get_rank() != 0:
        return
    for layout, result in runs.items():
        assert result.tokens.tolist() == single.tokens.tolist(), layout
        np.testing.assert_allclose(result.logprobs.values, single.logprobs.values, atol=1e-4,
                                   err_msg=str(layout))
        np.testing.assert_array_equal(result.logprobs.top_ids, single.logprobs.top_ids)


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
def test_two_rows_in_flight_under_every_layout_give_transformers_greedy_tokens(
        tmp_path_factory, monkeypatch):
    """Continuous batching, 2 slots per micro-batch refilled at different steps (per-prompt
    limits), under every layout of the world's size: transformers' tokens, row by row, in
    the result and in the output file, whose rows come to rank 0 at every step."""
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 250, n) for n in (6, 2, 13, 4, 9, 1, 11, 7, 3)]
    limits = [8, 2, 10, 1, 6, 10, 4, 9, 3]
    folder, expected = None, None
    if comm.Get_rank() == 0:
        import torch

        from helpers import build_hf_model
        folder = tmp_path_factory.mktemp("continuous")
        model, _ = build_hf_model("gqa-llama3", folder)
        with torch.no_grad():
            expected = [model.generate(torch.tensor(prompt[None]), max_new_tokens=k,
                                       do_sample=False,
                                       attention_mask=torch.ones(1, len(prompt),
                                                                 dtype=torch.long)
                                       )[0, len(prompt):].tolist()
                        for prompt, k in zip(prompts, limits)]
    folder = comm.bcast(str(folder) if folder else None, root=0)
    monkeypatch.setenv("HPCPAR_SAVE_SECONDS", "0")
    for dp, pp, tp, mbs in _layouts(comm, dict(GQA, num_hidden_layers=3)):
        sets = [f"model.checkpoint='{folder}/model.h5'", f"parallel.dp={dp}",
                f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.micro_batches={mbs}",
                "generate.max_new_tokens=10", "generate.stop_at_eos=false",
                "generate.batch_size=2", f"output.path='{folder}/{dp}-{pp}-{tp}-{mbs}.h5'"]
        result = run_generation(comm, load_job(None, sets),
                                prompts=Prompts(prompts, max_new_tokens=limits), progress=False)
        if comm.Get_rank() != 0:
            continue
        with h5py.File(f"{folder}/{dp}-{pp}-{tp}-{mbs}.h5") as f:
            np.testing.assert_array_equal(f["tokens"][()], result.tokens)
            np.testing.assert_array_equal(f["lengths"][()], limits)
        for b, (want, k) in enumerate(zip(expected, limits)):
            assert result.tokens[b, :k].tolist() == want, (b, dp, pp, tp, mbs)


class _FixedPayload:
    def payload(self, a):
        return (4,), np.float32


@pytest.mark.mpi(min_size=2)
def test_a_wrong_schedule_is_an_error_on_every_rank_before_any_step():
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.parallel.comm import create_communicator
    from hpcpar.parallel.errors import HpcparError
    from hpcpar.parallel.pipeline.executor import PipelineExecutor
    from hpcpar.parallel.pipeline.schedule import Op, gpipe_forward

    comm = MPI.COMM_WORLD
    pp = create_communicator(comm, "mpi", NUMPY, name="pp")
    stage, stages = comm.Get_rank(), comm.Get_size()
    executor = PipelineExecutor(pp, stage, _FixedPayload(), NUMPY, in_flight=2)
    good = gpipe_forward(stages, 2)[stage]
    executor.preflight(good)                                  # passes on every rank
    if stage == stages - 1:                                   # the last stage drops a receive
        bad = [a for a in good if not (a.op is Op.RECV and a.mb == 1)]
    else:
        bad = good
    with pytest.raises(HpcparError, match="never received|deadlock"):
        executor.preflight(bad)


# ---- context parallelism: prompts and KV cache split over cp ------------------------------

# (dp, pp, cp, tp, micro_batches), keyed by world size
CP_LAYOUTS = {
    2: [(1, 1, 2, 1, 1)],
    4: [(1, 1, 4, 1, 2), (1, 2, 2, 1, 2), (2, 1, 2, 1, 1), (1, 1, 2, 2, 1)],
    8: [(1, 1, 8, 1, 1), (2, 2, 2, 1, 2), (1, 2, 2, 2, 2)],
}
CP_CONFIGS = {"gqa": dict(GQA, max_position_embeddings=256),
              "qwen3": dict(QWEN3, max_position_embeddings=256)}
# prompts longer than one 128-position tile, of no length cp divides, and shorter than cp
LONG = [np.random.default_rng(3).integers(3, 240, n) for n in (150, 7, 1, 60, 131, 2)]


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the cp layouts of each world size
@pytest.mark.parametrize("family", sorted(CP_CONFIGS))
def test_generation_under_cp_gives_the_single_ranks_tokens(tmp_path_factory, family):
    """Prefill split over cp (ring attention), decode over the KV cache split over cp (the
    partial attentions merged): greedy and seeded tokens of one rank, static and continuous
    batching with refills, with dp, pp and tp."""
    comm = MPI.COMM_WORLD
    folder = None
    if comm.Get_rank() == 0:
        folder = tmp_path_factory.mktemp("cp-" + family)
        make_checkpoint(folder, CP_CONFIGS[family])
    path = comm.bcast(str(folder) if folder else None, root=0) + "/model.h5"
    sampling = [{}, {"temperature": 0.9, "top_k": 20, "seed": 5}]
    prompts = Prompts(LONG, sampling=[sampling[i % 2] for i in range(len(LONG))])

    def generate(comm, layout, **gen):
        dp, pp, cp, tp, mbs = layout
        sets = [f"model.checkpoint='{path}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
                f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.micro_batches={mbs}",
                "generate.max_new_tokens=8", "generate.stop_at_eos=false"]
        sets += [f"generate.{k}={v}" for k, v in gen.items()]
        return run_generation(comm, load_job(None, sets), prompts=prompts, progress=False)

    single = generate(MPI.COMM_SELF, (1, 1, 1, 1, 1)) if comm.Get_rank() == 0 else None
    for layout in CP_LAYOUTS[comm.Get_size()]:
        static = generate(comm, layout, batching="'static'")
        refilled = generate(comm, layout, batch_size=2)
        if comm.Get_rank() == 0:
            assert static.tokens.tolist() == single.tokens.tolist(), layout
            assert refilled.tokens.tolist() == single.tokens.tolist(), layout
