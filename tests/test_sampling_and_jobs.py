"""Sampling (pure) and job files (TOML, --set, flags)."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.parallel.comm import create_communicator
from hpcpar.jobs.generate.sampling import sample_from_candidates
from hpcpar.jobs.inputs.sampling_settings import SamplingParams
from hpcpar.jobs.job import JobError, load_job, parse_set
from hpcpar.parallel.tensor_parallel.layers import Frozen
from hpcpar.parallel.tensor_parallel.vocab import ParallelLMHead
from hpcpar.parallel.ops import native_ops


def _sorted(logits):
    ids = np.argsort(-logits, axis=1, kind="stable")
    return np.take_along_axis(logits, ids, axis=1), ids


def test_sampling_follows_the_softmax_of_the_scaled_logits():
    logits = np.array([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.7, seed=3)
    vals, ids = _sorted(logits)
    draws = np.array([sample_from_candidates(vals, ids, params, np.array([0]), step)[0]
                      for step in range(4000)])
    p = np.exp(logits[0] / 0.7)
    p /= p.sum()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.abs(freq - p).max() < 0.03, (freq, p)


def test_top_k_and_top_p_cut_the_tail():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    vals, ids = _sorted(logits)
    rows = np.array([0])
    top_k = {int(sample_from_candidates(vals, ids, SamplingParams(1.0, top_k=2, seed=s), rows, 0)[0])
             for s in range(300)}
    assert top_k == {0, 1}
    top_p = {int(sample_from_candidates(vals, ids, SamplingParams(1.0, top_p=0.7, seed=s), rows, 0)[0])
             for s in range(300)}
    assert top_p == {0, 1}          # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 are cut
    tiny_p = {int(sample_from_candidates(vals, ids, SamplingParams(1.0, top_p=1e-6, seed=s), rows, 0)[0])
              for s in range(50)}
    assert tiny_p == {0}


def test_a_rows_draw_depends_on_its_prompt_index_and_step_not_on_its_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50))
    vals, ids = _sorted(logits)
    params = SamplingParams(temperature=1.0, seed=11)
    whole = sample_from_candidates(vals, ids, params, np.arange(6), step=4)
    parts = np.concatenate([sample_from_candidates(vals[:2], ids[:2], params, np.arange(2), 4),
                            sample_from_candidates(vals[2:], ids[2:], params, np.arange(2, 6), 4)])
    assert whole.tolist() == parts.tolist()
    other_seed = sample_from_candidates(vals, ids, SamplingParams(1.0, seed=12), np.arange(6), 4)
    assert other_seed.tolist() != whole.tolist()


def test_each_row_draws_with_its_own_prompts_settings():
    """Rows of one call, each cut by its prompt's own top-k / top-p: the draws of a call with
    that prompt's settings for every row. A prompt with a seed of its own draws as vLLM's
    per-request seed does: the same wherever the prompt is (its index is not in the key),
    and not as the job's seed would."""
    from hpcpar.jobs.inputs.sampling_settings import PromptSampling
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4))
    vals, ids = _sorted(logits)
    own = [{"top_k": 1}, {"top_k": 2, "seed": 7}, {"top_p": 0.7}, {"temperature": 3.0}]
    job = SamplingParams(temperature=1.0, seed=1)
    prompts = PromptSampling.build(job, [{}] * 6 + own)          # prompts 6..9 are these rows
    moved = PromptSampling.build(job, [own[1]] + [{}] * 9)       # the seeded one at 0
    rows = np.arange(6, 10)
    as_jobs = []
    for step in range(40):
        got = sample_from_candidates(vals, ids, prompts, rows, step)
        for i, settings in enumerate(own):
            alone = SamplingParams(**{"temperature": 1.0, "seed": 1, **settings})
            theirs = sample_from_candidates(vals[i:i + 1], ids[i:i + 1], alone, rows[i:i + 1],
                                            step)[0]
            if "seed" in settings:
                as_jobs.append(got[i] == theirs)
                assert got[i] == sample_from_candidates(vals[i:i + 1], ids[i:i + 1], moved,
                                                        np.array([0]), step)[0], step
            else:
                assert got[i] == theirs, (settings, step)
        assert got[0] == 0 and got[1] in (0, 1) and got[2] in (0, 1)
    assert not all(as_jobs)            # keyed without the index: not the job seed's draws


def test_bad_sampling_parameters_are_named():
    assert len(SamplingParams(temperature=-1, top_k=-2, top_p=1.5).problems()) == 3


def test_lm_head_argmax_and_top_k_on_one_rank_match_numpy():
    tp = create_communicator(MPI.COMM_SELF, "mpi", name="tp")
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((40, 8)).astype(np.float32)
    weight[37:] = 100.0                                # 3 padding rows must never win
    head = ParallelLMHead(native_ops(np), Frozen(weight), 37, tp)
    h = rng.standard_normal((5, 8)).astype(np.float32)
    local = head.local_logits(h)
    expected = h @ weight[:37].T
    assert head.argmax(local).tolist() == expected.argmax(axis=1).tolist()
    vals, ids = head.top_k(local, 4)
    assert ids.tolist() == np.argsort(-expected, axis=1)[:, :4].tolist()
    np.testing.assert_allclose(vals, np.sort(expected, axis=1)[:, ::-1][:, :4], rtol=1e-6)
    assert head.full_logits(local).shape == (5, 37)


def test_a_step_of_greedy_and_top_k_rows_reads_the_device_once():
    """The greedy rows take their best candidate from the drawn rows' top-k exchange (ties to
    the lower id, as the argmax), so a mixed step reads its candidates once, in one array."""
    from hpcpar.jobs.generate.sampling import next_tokens
    from hpcpar.jobs.inputs.sampling_settings import PromptSampling
    from hpcpar.parallel.device.backend import ArrayBackend
    from hpcpar.parallel.device.budget import Budget
    from hpcpar.parallel.device.strict_arrays import xp
    tp = create_communicator(MPI.COMM_SELF, "mpi", backend=ArrayBackend("strict", xp),
                             name="tp")
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((30, 8)).astype(np.float32)
    weight[7] = weight[3]                              # a tie: the lower id, 3, wins
    head = ParallelLMHead(native_ops(xp), Frozen(xp.asarray(weight)), 30, tp)
    h = rng.standard_normal((4, 8)).astype(np.float32)
    h[0] = weight[3] * 10
    settings = PromptSampling.build(SamplingParams(temperature=0.0, seed=1),
                                    [{}, {"temperature": 0.9, "top_k": 3}, {},
                                     {"temperature": 1.5, "top_k": 5}])
    budget = Budget()
    with budget.counting():
        tokens = next_tokens(head, head.local_logits(xp.asarray(h)), settings, np.arange(4),
                             0, lambda a: a.get())
    assert budget.total.reads == 1
    expected = h @ weight.T
    assert tokens[0] == 3 and tokens[2] == expected[2].argmax()
    assert tokens[1] in np.argsort(-expected[1])[:3] and tokens[3] in np.argsort(-expected[3])[:5]


def test_job_file_sets_and_flags_override_in_order(tmp_path):
    (tmp_path / "job.toml").write_text(
        '[model]\ncheckpoint = "m.h5"\n[data]\nprompts = "p.jsonl"\n'
        '[generate]\nmax_new_tokens = 8\ntemperature = 0.5\n[parallel]\ntp = 2\n')
    job = load_job(tmp_path / "job.toml", ["generate.max_new_tokens=32", "parallel.tp=4"],
                   {("parallel", "tp"): 8, ("generate", "seed"): None})
    assert job.model.checkpoint == str(tmp_path / "m.h5")   # relative to the job file
    assert job.data.prompts == str(tmp_path / "p.jsonl")
    assert job.generate.max_new_tokens == 32 and job.generate.temperature == 0.5
    assert job.parallel.tp == 8 and job.generate.seed == 0


def test_job_errors_name_every_problem(tmp_path):
    (tmp_path / "bad.toml").write_text('[generat]\nx = 1\n[model]\ncheckpont = "a"\n'
                                       '[parallel]\ntp = "two"\n')
    with pytest.raises(JobError) as e:
        load_job(tmp_path / "bad.toml")
    msg = str(e.value)
    assert "unknown section [generat]" in msg and "unknown key model.checkpont" in msg
    assert "did you mean model.checkpoint?" in msg          # the closest key, where one is
    assert "did you mean [generate]?" in msg
    assert "parallel.tp = 'two': expected int" in msg
    with pytest.raises(JobError, match="not valid TOML"):
        (tmp_path / "broken.toml").write_text("[model\n")
        load_job(tmp_path / "broken.toml")
    with pytest.raises(JobError, match="expected section.key=value"):
        parse_set("max_new_tokens=3")


def test_set_values_are_read_as_toml():
    assert parse_set("parallel.stage_layers=[2,1]") == ("parallel", "stage_layers", [2, 1])
    assert parse_set("generate.save_logits=true")[2] is True
    assert parse_set("model.checkpoint=dir/m.h5")[2] == "dir/m.h5"


def test_prompts_given_to_the_library_are_integer_ids_one_row_each():
    """A float id would be cut to an integer and a 2-D array read as one row: both are one
    error when the ``Prompts`` are made; lists of ints are taken as arrays."""
    from hpcpar.jobs.generate import Prompts
    from hpcpar.parallel.errors import HpcparError
    prompts = Prompts([[1, 2, 3], np.array([4], dtype=np.int32)])
    assert [row.dtype for row in prompts.ids] == [np.int64, np.int64]
    assert prompts.ids[0].tolist() == [1, 2, 3]
    with pytest.raises(HpcparError, match="prompt 1 is a 1-D array of float64"):
        Prompts([np.array([1, 2]), np.array([1.5, 2.0])])
    with pytest.raises(HpcparError, match="prompt 0 is a 2-D array of int64"):
        Prompts([np.array([[1, 2], [3, 4]])])


class _Checkpoint:
    """What ``model_sampling_note`` reads of a checkpoint: its kept generation_config.json."""

    def __init__(self, config: dict | None):
        import json
        self.path = "model.h5"
        self.files = {} if config is None else {
            "generation_config.json": json.dumps(config).encode()}

    def tokenizer_files(self):
        return self.files


def test_the_models_own_sampling_settings_are_named_where_the_job_sets_none():
    """transformers' generate() samples as generation_config.json says (its top_k 50 where
    the file names none, temperature and the rest only with do_sample, a repetition penalty
    either way); hpcpar applies the job's settings alone and says, once, which flags give
    the model's."""
    import transformers
    from hpcpar.jobs.inputs.stage import model_sampling_note
    from hpcpar.jobs.job import GenerateSection
    plain = GenerateSection()
    note = model_sampling_note(_Checkpoint({"do_sample": True, "temperature": 0.6,
                                            "top_p": 0.9, "eos_token_id": 1}), plain)
    # transformers' own default where neither the model nor the call sets one
    top_k = transformers.GenerationConfig._get_default_generation_params()["top_k"]
    assert note.startswith("hpcpar: note: the model's generation_config.json asks for ")
    assert note.endswith(f"pass --temperature 0.6 --top-k {top_k} --top-p 0.9 for the model's")
    assert "--repetition-penalty 1.2 for" in model_sampling_note(
        _Checkpoint({"repetition_penalty": 1.2}), plain)
    for quiet in ({"temperature": 0.6}, {"do_sample": False, "top_p": 0.5}, {}, None):
        assert model_sampling_note(_Checkpoint(quiet), plain) is None, quiet
    asked = GenerateSection(temperature=0.7)
    assert model_sampling_note(_Checkpoint({"do_sample": True}), asked) is None
