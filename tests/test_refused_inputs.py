"""Inputs a job cannot use, each refused with one line and exit 2 before any work: outputs
that are inputs, damaged weights, non-finite sampling settings, unwritable or busy outputs,
unreadable input files; and temporaries a crashed writer left behind are cleaned up."""

import json
import os
import shutil
import socket

import h5py
import numpy as np
import pytest

from helpers import GQA, make_checkpoint, mpirun, realistic_tensors, write_hf_checkpoint
from test_generate_cli import _assert_one_error


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refused")
    make_checkpoint(folder, GQA)
    (folder / "ids.jsonl").write_text('{"ids": [5, 6, 7]}\n{"ids": [9, 10]}\n')
    np.save(folder / "data.npy", np.random.default_rng(0).integers(0, 250, (16, 9)))
    return folder


def _generate(work, *args, n=2):
    return mpirun(n, ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts",
                      "ids.jsonl", "--max-new-tokens", "3", *args], work)[0]


def _digest(path):
    return path.stat().st_mtime_ns, path.read_bytes()[:4096]


@pytest.mark.slow
@pytest.mark.parametrize("out, what", [("model.h5", "the checkpoint"),
                                       ("ids.jsonl", "the prompts")])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(work, out, what):
    before = _digest(work / out)
    proc = _generate(work, "--out", out)
    _assert_one_error(proc, f"{what} ")
    assert "would destroy it" in proc.stderr
    assert _digest(work / out) == before


@pytest.mark.slow
def test_convert_onto_its_own_source_weights_is_refused(work):
    before = _digest(work / "hf" / "model.safetensors")
    proc = mpirun(1, ["-m", "hpcpar", "convert", "hf", "hf/model.safetensors"], work)[0]
    _assert_one_error(proc, "source file model.safetensors")
    assert _digest(work / "hf" / "model.safetensors") == before


@pytest.mark.slow
def test_training_into_the_folder_of_its_checkpoint_is_refused(work):
    (work / "run").mkdir(exist_ok=True)
    shutil.copy(work / "model.h5", work / "run" / "start.h5")
    proc = mpirun(1, ["-m", "hpcpar", "train", "--checkpoint", "run/start.h5", "--data",
                      "data.npy", "--steps", "1", "--global-batch", "4", "--out", "run"],
                  work)[0]
    _assert_one_error(proc, "lies inside the output run")


@pytest.mark.slow
def test_nan_weights_are_refused_at_load_naming_the_tensor(work):
    shutil.copy(work / "model.h5", work / "nan.h5")
    with h5py.File(work / "nan.h5", "r+") as f:
        f["model.layers.1.mlp.up_proj.weight"][3, 7] = np.nan
    proc = mpirun(2, ["-m", "hpcpar", "generate", "--checkpoint", "nan.h5", "--prompts",
                      "ids.jsonl", "--max-new-tokens", "3", "--out", "x.h5", "--tp", "2"],
                  work)[0]
    _assert_one_error(proc, "model.layers.1.mlp.up_proj.weight holds NaN or inf values")
    assert not (work / "x.h5").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flags, words", [
    (["--temperature", "nan"], "--temperature: generate.temperature must be >= 0 (0 is greedy), got nan"),
    (["--temperature", "1", "--top-p", "inf"], "generate.top_p must be in (0, 1], got inf"),
    (["--seed", "-1"], "seed must be in [0, 2^63)"),
])
def test_non_finite_or_out_of_range_sampling_settings_are_refused(work, flags, words):
    _assert_one_error(_generate(work, "--out", "x.h5", *flags), words)


@pytest.mark.slow
def test_an_unwritable_output_folder_is_found_before_any_work(work):
    proc = _generate(work, "--out", "/proc/hpcpar-out.h5")
    _assert_one_error(proc, "cannot write into /proc")


@pytest.mark.slow
def test_a_busy_output_is_refused_and_a_dead_writers_leftovers_are_cleaned(work):
    host = socket.gethostname()
    lock = work / ".busy.h5.lock"
    lock.write_text(f"{host}:{os.getpid()}\n")             # this test process: alive
    _assert_one_error(_generate(work, "--out", "busy.h5"), "another job")
    lock.write_text(f"{host}:999999999\n")                 # a writer that is gone
    stale = work / f".busy.h5.tmp-{host}-999999999"
    stale.write_bytes(b"half a file")
    proc = _generate(work, "--out", "busy.h5")
    assert proc.returncode == 0, proc.stderr
    assert (work / "busy.h5").exists()
    assert not stale.exists() and not lock.exists()


@pytest.mark.slow
def test_unreadable_inputs_are_one_line_not_a_traceback(work):
    (work / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    _assert_one_error(_generate(work, "--out", "x.h5", "--prompts", "latin1.jsonl"),
                      "not UTF-8 text")
    (work / "huge.jsonl").write_text(json.dumps({"ids": [5, 2 ** 70]}) + "\n")
    _assert_one_error(_generate(work, "--out", "x.h5", "--prompts", "huge.jsonl"),
                      "is out of range")
    (work / "job_dir.toml").mkdir(exist_ok=True)
    proc = mpirun(2, ["-m", "hpcpar", "run", "job_dir.toml"], work)[0]
    _assert_one_error(proc, "is a folder, not a job file")
    shutil.copy(work / "model.h5", work / "badcfg.h5")
    with h5py.File(work / "badcfg.h5", "r+") as f:
        cfg = json.loads(f.attrs["hf_config"])
        cfg["hidden_size"] = "sixty-four"
        f.attrs["hf_config"] = json.dumps(cfg)
    proc = mpirun(2, ["-m", "hpcpar", "generate", "--checkpoint", "badcfg.h5", "--prompts",
                      "ids.jsonl", "--max-new-tokens", "3", "--out", "x.h5"], work)[0]
    _assert_one_error(proc, "hidden_size must be a positive integer, got 'sixty-four'")


@pytest.mark.slow
def test_ambiguous_or_misnamed_inputs_are_one_line_each(work):
    """Inputs that could be taken without a word are each one line, exit 2: a JSON
    line with a key twice (the last would win), a file named .npy that is not one (NumPy's
    message would blame pickled data) for generation, scoring and training, a tensor the config
    has no place for (it would be left unused: a bias with attention_bias off), a plan for 0
    ranks, a Slurm time limit sbatch cannot read, and a time-limit signal no earlier than the
    limit itself."""
    (work / "twice.jsonl").write_text('{"ids": [5, 6], "ids": [7, 8, 9]}\n')
    _assert_one_error(_generate(work, "--out", "x.jsonl", "--prompts", "twice.jsonl"),
                      "twice.jsonl:1: the key 'ids' appears twice in one object")
    (work / "text.npy").write_text("5 6 7\n")
    _assert_one_error(_generate(work, "--out", "x.jsonl", "--prompts", "text.npy"),
                      "text.npy: not a .npy file (it does not begin with NumPy's header)")
    for command, flags in (("score", ["--data", "text.npy", "--out", "s.h5"]),
                           ("train", ["--data", "text.npy", "--steps", "1", "--global-batch",
                                      "2", "--out", "run-npy"])):
        proc = mpirun(1, ["-m", "hpcpar", command, "--checkpoint", "model.h5", *flags],
                      work)[0]
        _assert_one_error(proc, "text.npy: not a .npy file")
    shutil.copy(work / "model.h5", work / "extra.h5")
    with h5py.File(work / "extra.h5", "r+") as f:
        width = f["model.layers.0.self_attn.q_proj.weight"].shape[0]
        f["model.layers.0.self_attn.q_proj.bias"] = np.ones(width, np.float32)
    proc = mpirun(1, ["-m", "hpcpar", "generate", "--checkpoint", "extra.h5", "--prompts",
                      "ids.jsonl", "--max-new-tokens", "2", "--out", "x.jsonl"], work)[0]
    _assert_one_error(proc, "tensor model.layers.0.self_attn.q_proj.bias is not one of the "
                            "model its config describes")
    _assert_one_error(mpirun(1, ["-m", "hpcpar", "plan", "--preset", "tiny", "--world", "0"],
                             work)[0], "--world: must be at least 1, got 0")
    proc = mpirun(1, ["-m", "hpcpar", "submit", "job.toml", "--time", "abc", "--dry-run"],
                  work)[0]
    _assert_one_error(proc, "'abc' is not a Slurm time limit")
    (work / "job.toml").write_text('[model]\ncheckpoint = "model.h5"\n')
    proc = mpirun(1, ["-m", "hpcpar", "submit", "job.toml", "--time", "1", "--signal-seconds",
                      "120", "--dry-run"], work)[0]
    _assert_one_error(proc, "--signal-seconds 120 is not less than the time limit --time 1 "
                            "(60 s)")
    assert not (work / "x.jsonl").exists() and not (work / "s.h5").exists()


@pytest.mark.slow
def test_init_and_convert_replace_a_model_checkpoint_not_a_training_one(work):
    """Converting or initialising again replaces an earlier model checkpoint; a training
    run's checkpoint (its optimizer state too) is kept, with one line."""
    proc = mpirun(1, ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data",
                      "data.npy", "--steps", "1", "--global-batch", "2", "--out", "trained"],
                  work)[0]
    assert proc.returncode == 0, proc.stderr
    saved = work / "trained" / "step-1.h5"
    before = _digest(saved)
    for args in (["init", "--preset", "tiny", str(saved)], ["convert", "hf", str(saved)]):
        _assert_one_error(mpirun(1, ["-m", "hpcpar", *args], work)[0],
                          "is an hpcpar training checkpoint file")
        assert _digest(saved) == before
    shutil.copy(work / "model.h5", work / "again.h5")
    proc = mpirun(1, ["-m", "hpcpar", "init", "--preset", "tiny", "again.h5"], work)[0]
    assert proc.returncode == 0 and "wrote again.h5" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_a_sharded_index_naming_a_missing_shard_is_one_line(work):
    folder = work / "sharded"
    write_hf_checkpoint(folder, GQA, files=3, extra=realistic_tensors(GQA, 1))
    (folder / "model-00002-of-00003.safetensors").unlink()
    proc = mpirun(1, ["-m", "hpcpar", "convert", "sharded", "sharded.h5"], work)[0]
    _assert_one_error(proc, "the index names model-00002-of-00003.safetensors")
    assert not (work / "sharded.h5").exists()


def test_malformed_config_values_are_a_config_error():
    from hpcpar.models.config import ConfigError, ModelConfig
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    for bad, words in [({"hidden_size": "abc"}, "malformed value"),
                       ({"rms_norm_eps": "x"}, "malformed value"),
                       ({"eos_token_id": {"a": 1}}, "eos_token_id must be an integer")]:
        with pytest.raises(ConfigError, match=words):
            ModelConfig.from_hf(dict(base, **bad))


def test_a_broken_json_line_and_scoring_data_of_another_kind_say_where_and_what(tmp_path):
    """A .jsonl line that does not parse names its line and column (json's message alone,
    "Unterminated string starting at", stopped short); scoring data of another kind is named
    as scoring data and says what it can be, not as prompts."""
    from hpcpar.jobs.inputs.prompts import load_prompts
    from hpcpar.jobs.score.data import load_score_data
    from hpcpar.parallel.errors import HpcparError
    (tmp_path / "bad.jsonl").write_text('{"ids": [5, 6]}\n{"text": "open\n')
    with pytest.raises(HpcparError, match=r"bad\.jsonl:2: not valid JSON \(Unterminated "
                                          r"string starting at, column 10\)"):
        load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "data.txt").write_text("some text\n")
    with pytest.raises(HpcparError, match=r"data\.txt: scoring data must be a \.npy of token "
                                          r"ids \[rows, tokens\] or a \.jsonl .* not \.txt"):
        load_score_data(tmp_path / "data.txt")
