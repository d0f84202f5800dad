"""Every class of fault a user meets ends as one line from one rank, a documented status on
every rank, nothing half-written and no input touched (docs/design.md §7): numeric settings out of
range from any source, data and outputs of the wrong kind, damaged partial files, failed
writes (a full disk, a failing or read-only file system) and Ctrl-C."""

import json
import os
import shutil

import h5py
import numpy as np
import pytest

from helpers import GQA, hpcpar_here, make_checkpoint, mpirun
from hpcpar.jobs import settings
from hpcpar.parallel.errors import HpcparError
from hpcpar.jobs.job import JobError, load_job
from test_generate_cli import _assert_one_error

GENERATE = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts", "prompts.npy",
            "--max-new-tokens", "6", "--ignore-eos"]
TRAIN = ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data", "data.npy",
         "--global-batch", "4", "--steps", "3"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fault-classes")
    make_checkpoint(folder, GQA)
    rng = np.random.default_rng(2)
    np.save(folder / "prompts.npy", rng.integers(3, 250, (24, 5)))
    np.save(folder / "data.npy", rng.integers(0, 250, (16, 9)))
    return folder


def _snapshot(folder):
    """Every file's bytes and modification time under ``folder`` (hidden ones included)."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".lock")}


# ---- settings: one rule each, whatever the source ------------------------------------------

@pytest.mark.parametrize("name, value, valid", [
    ("train.lr", float("nan"), 1e-3), ("train.lr", float("inf"), 1e-3), ("train.lr", -1.0, 0.0),
    ("generate.wave_size", -1, 0), ("parallel.timeout", -1.0, 0.0),
    ("parallel.timeout", float("inf"), 60.0), ("train.betas", [0.9, 1.0], [0.9, 0.95]),
    ("generate.top_p", 0.0, 1.0), ("train.seq_len", 1, 2), ("train.zero", 4, 3),
    ("train.bucket_mb", 0.0, 0.5)])
def test_a_setting_outside_its_range_is_refused_from_every_source(tmp_path, name, value,
                                                                   valid):
    section, key = name.split(".")
    text = json.dumps(value) if not isinstance(value, float) or np.isfinite(value) else (
        "nan" if np.isnan(value) else "inf")
    (tmp_path / "job.toml").write_text(f"[{section}]\n{key} = {text}\n")
    sources = {"job file": lambda: load_job(tmp_path / "job.toml"),
               "--set": lambda: load_job(None, [f"{name}={text}"]),
               "flag": lambda: load_job(None, [], {(section, key): value},
                                        {(section, key): "--" + key.replace("_", "-")})}
    for source, load in sources.items():
        with pytest.raises(JobError, match=f"{name} must be") as e:
            load()
        where = {"job file": "job.toml", "--set": f"--set {name}=",
                 "flag": "--" + key.replace("_", "-")}[source]
        assert where in str(e.value), (source, str(e.value))
    assert settings.problem(name, value) is not None
    assert settings.problem(name, valid) is None
    load_job(None, [], {(section, key): valid})


def test_the_rules_describe_their_range_and_the_edge_meaning():
    assert settings.RULES["generate.top_p"].describe() == "in (0, 1]"
    assert settings.RULES["train.seed"].describe() == "in [0, 2^63)"
    assert "0 waits forever" in settings.RULES["parallel.timeout"].describe()
    assert settings.problem("train.lr", 3e-4) is None
    assert settings.problem("generate.seed", 2 ** 63) == "generate.seed must be in [0, 2^63), got " \
                                                       f"{2 ** 63}"


@pytest.mark.parametrize("text, ok", [("abc", False), ("-1", False), ("nan", False),
                                      ("inf", False), ("0", True), ("2.5", True), ("", True)])
def test_environment_numbers_are_checked_before_any_work(monkeypatch, text, ok):
    monkeypatch.setenv("HPCPAR_SAVE_SECONDS", text)
    if ok:
        settings.check_environment()
        assert settings.environment_number("HPCPAR_SAVE_SECONDS") == (float(text) if text
                                                                       else 1.0)
    else:
        with pytest.raises(HpcparError, match="HPCPAR_SAVE_SECONDS=.*must be a number >= 0"):
            settings.check_environment()


def test_a_bad_set_key_is_blamed_on_the_set_not_the_job_file(tmp_path):
    (tmp_path / "job.toml").write_text("[generate]\nmax_new_tokens = 4\n")
    with pytest.raises(JobError) as e:
        load_job(tmp_path / "job.toml", ["generate.max_new_tokns=8"])
    assert str(e.value).startswith("--set generate.max_new_tokns=8: unknown key")


@pytest.mark.parametrize("args, words", [
    (TRAIN + ["--out", "nan-run", "--lr", "nan"], "--lr: train.lr must be >= 0, got nan"),
    (GENERATE + ["--out", "w.h5", "--wave-size", "-1"], "generate.wave_size must be >= 0"),
    (GENERATE + ["--out", "w.h5", "--timeout", "-1"], "parallel.timeout must be >= 0"),
    (GENERATE + ["--out", "x.txt"], "writes HDF5 or JSON lines; give a name ending in .h5, .hdf5, .jsonl"),
    (TRAIN + ["--out", "long", "--data", "synthetic", "--seq-len", "97"],
     "exceed the model's max_position_embeddings 96; lower --seq-len to at most 96"),
    (TRAIN + ["--out", "odd", "--data", "odd.bin", "--seq-len", "4"],
     "3 bytes is not a whole number of uint16 tokens"),
    (["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data", "one.npy", "--out",
      "s.h5"], "every row holds a single token"),
])
def test_settings_and_data_that_used_to_slip_through_are_one_error(work, args, words):
    (work / "odd.bin").write_bytes(b"\x01\x02\x03")
    np.save(work / "one.npy", np.array([[5], [7]]))
    before = _snapshot(work)
    proc = hpcpar_here(args[2:], work)                 # ("-m", "hpcpar", ...) in this process
    _assert_one_error(proc, words)
    assert _snapshot(work) == before                   # nothing written, no input touched
    assert not (work / "nan-run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_an_environment_variable_is_checked_on_every_rank_before_any_work(work):
    os.environ["HPCPAR_SAVE_SECONDS"] = "abc"
    try:
        proc, _ = mpirun(2, GENERATE + ["--out", "env.h5"], work, timeout=120)
    finally:
        del os.environ["HPCPAR_SAVE_SECONDS"]
    _assert_one_error(proc, "HPCPAR_SAVE_SECONDS='abc': must be a number >= 0")
    assert not list(work.glob("*env.h5*"))


@pytest.mark.slow
def test_a_file_that_is_not_an_hpcpar_output_of_the_kind_is_never_replaced(work):
    (work / "notes.h5").write_text("my notes\n")
    proc, _ = mpirun(2, GENERATE + ["--out", "notes.h5"], work, timeout=120)
    _assert_one_error(proc, "exists and is not an hpcpar output")
    assert (work / "notes.h5").read_text() == "my notes\n"
    proc, _ = mpirun(2, GENERATE + ["--out", "gen.h5"], work, timeout=120)
    assert proc.returncode == 0, proc.stderr
    score = ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data", "prompts.npy"]
    proc, _ = mpirun(2, score + ["--out", "gen.h5"], work, timeout=120)
    _assert_one_error(proc, "is an hpcpar generation file; this command writes a scores file")
    proc, _ = mpirun(2, GENERATE + ["--out", "gen.h5"], work, timeout=120)   # same kind: fine
    assert proc.returncode == 0, proc.stderr


# ---- damaged partial files -----------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped(work):
    """A partial file of a run stopped after some prompts (a raise at decode step 8)."""
    os.environ.update(HPCPAR_FAULT="rank=0,phase=decode,step=8,kind=raise",
                      HPCPAR_SAVE_SECONDS="0")
    try:
        proc, _ = mpirun(1, GENERATE + ["--out", "stopped.h5", "--batch-size", "4"], work,
                         timeout=120)
    finally:
        del os.environ["HPCPAR_FAULT"], os.environ["HPCPAR_SAVE_SECONDS"]
    assert proc.returncode == 1, proc.stderr
    partial = work / ".stopped.h5.partial"
    with h5py.File(partial) as f:
        assert 0 < f["done"][()].sum() < 24
    return partial


def _damage_done(f):
    del f["done"]


def _damage_width(f):
    tokens = f["tokens"][()]
    del f["tokens"]
    f["tokens"] = tokens[:, :4]


def _damage_token(f):
    f["tokens"][int(np.flatnonzero(f["done"][()])[0]), 0] = 9999


def _damage_length(f):
    f["lengths"][int(np.flatnonzero(f["done"][()])[0])] = 50


def _damage_run(f):
    f.attrs["run"] = "{not json"


@pytest.mark.slow
@pytest.mark.parametrize("damage, words", [
    (_damage_done, "the done dataset is missing"),
    (_damage_width, "tokens is int64 [24, 4] where this run needs integers [24, 6]"),
    (_damage_token, "holds token id 9999, outside the model's vocabulary [0, 250)"),
    (_damage_length, "is marked finished with 50 new tokens, outside [1, 6]"),
    (_damage_run, "its run settings are missing or unreadable"),
])
def test_a_damaged_partial_file_is_refused_before_any_work_and_left_untouched(
        work, stopped, damage, words):
    partial = work / ".damaged.h5.partial"
    shutil.copy(stopped, partial)
    with h5py.File(partial, "r+") as f:
        damage(f)
    os.utime(partial, ns=(10 ** 18, 10 ** 18))
    before = partial.read_bytes()
    proc = hpcpar_here(GENERATE[2:] + ["--out", "damaged.h5", "--resume", "auto"], work)
    _assert_one_error(proc, words)
    assert "remove it to start over" in proc.stderr
    assert partial.read_bytes() == before and partial.stat().st_mtime_ns == 10 ** 18
    assert not (work / "damaged.h5").exists()
    partial.unlink()


@pytest.mark.slow
def test_a_refused_resume_names_the_settings_that_differ(work, stopped):
    partial = work / ".differ.h5.partial"
    shutil.copy(stopped, partial)
    args = [a if a != "6" else "5" for a in GENERATE]              # --max-new-tokens 5
    proc, _ = mpirun(2, args + ["--out", "differ.h5", "--resume", "auto", "--temperature",
                                "0.5"], work, timeout=120)
    _assert_one_error(proc, "this run has max_new_tokens 5 (the stopped run had 6); "
                            "temperature 0.5 (the stopped run had 0.0)")
    assert "prompts" not in proc.stderr.split("this run has")[1]    # the prompts are the same
    partial.unlink()


# ---- failed writes ---------------------------------------------------------------------------

def _with_fault(spec: str, n: int, args, work, **env):
    os.environ.update(HPCPAR_FAULT=spec, **env)
    try:
        return mpirun(n, args, work, timeout=120)[0]
    finally:
        for key in ("HPCPAR_FAULT", *env):
            del os.environ[key]


def _leftovers(work, name):
    return sorted(p.name for p in work.iterdir() if name in p.name and "partial" not in p.name)


@pytest.mark.slow
@pytest.mark.parametrize("kind, cause", [("enospc", "No space left on device"),
                                         ("eio", "Input/output error"),
                                         ("erofs", "Read-only file system")])
def test_a_failed_write_of_a_generation_keeps_a_resumable_partial_file(work, kind, cause):
    """Rank 0's third write (rows streamed at every step) fails: one line naming the file
    and the cause, status 2 on every rank; the partial file resumes to the output of an
    uninterrupted run."""
    name = f"full-{kind}.h5"
    proc = _with_fault(f"rank=0,phase=write,step=3,kind={kind}", 2,
                       GENERATE + ["--out", name, "--dp", "2", "--batch-size", "4"], work,
                       HPCPAR_SAVE_SECONDS="0")
    _assert_one_error(proc, f"cannot write .{name}.partial: {cause}")
    assert "run again with --resume auto" in proc.stderr
    assert not (work / name).exists() and not _leftovers(work, f".{name}.tmp")
    proc, _ = mpirun(2, GENERATE + ["--out", name, "--resume", "auto"], work, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc, _ = mpirun(2, GENERATE + ["--out", f"whole-{kind}.h5"], work, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(work / name) as resumed, h5py.File(work / f"whole-{kind}.h5") as whole:
        np.testing.assert_array_equal(resumed["tokens"][()], whole["tokens"][()])


@pytest.mark.slow
def test_a_generation_whose_first_write_fails_leaves_no_file(work):
    """The partial file's creation fails: nothing had finished, nothing is kept."""
    proc = _with_fault("rank=0,phase=write,step=1,kind=enospc", 2,
                       GENERATE + ["--out", "first.h5", "--dp", "2"], work)
    _assert_one_error(proc, "cannot write .first.h5.partial: No space left on device; free "
                            "space or write elsewhere; no prompt had finished")
    assert not [p for p in work.iterdir() if "first.h5" in p.name]


@pytest.mark.slow
def test_a_failed_write_of_scores_leaves_nothing(work):
    args = ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data", "prompts.npy",
            "--out", "scores.h5"]
    proc = _with_fault("rank=0,phase=write,step=1,kind=enospc", 2, args, work)
    _assert_one_error(proc, "cannot write scores.h5: No space left on device")
    assert not _leftovers(work, "scores.h5")


@pytest.mark.slow
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(work):
    """Rank 1's write of its slices of step 2 fails (its first write point is step 1's):
    ``latest`` still names step 1, no temporary is left, and the run resumes from it."""
    args = TRAIN + ["--out", "ckpt-full", "--tp", "2", "--save-every", "1"]
    proc = _with_fault("rank=1,phase=write,step=2,kind=enospc", 2, args, work)
    _assert_one_error(proc, "step-2.h5: No space left on device")
    out = work / "ckpt-full"
    assert (out / "latest").read_text().strip() == "step-1.h5"
    assert sorted(p.name for p in out.iterdir()) == ["latest", "metrics.jsonl", "step-1.h5",
                                                     "step-1.parts"]
    proc, _ = mpirun(2, args + ["--resume", "auto"], work, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "latest").read_text().strip() == "step-3.h5"


@pytest.mark.slow
def test_a_failed_metrics_write_ends_every_rank_with_one_line(work):
    """Rank 0's first write is step 1's line of metrics."""
    args = TRAIN + ["--out", "metrics-full", "--dp", "2"]
    proc = _with_fault("rank=0,phase=write,step=1,kind=enospc", 2, args, work)
    _assert_one_error(proc, "metrics.jsonl: No space left on device")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["init", "convert"])
def test_a_failed_checkpoint_conversion_leaves_no_file(work, command):
    args = (["-m", "hpcpar", "init", "--preset", "tiny", "made.h5"] if command == "init" else
            ["-m", "hpcpar", "convert", "hf", "made.h5"])
    proc = _with_fault("rank=0,phase=write,step=2,kind=enospc", 1, args, work)
    _assert_one_error(proc, "cannot write made.h5: No space left on device")
    assert not _leftovers(work, "made.h5")


def test_too_little_space_is_found_before_the_file_is_created(tmp_path, monkeypatch):
    from hpcpar.checkpoint.files import WriteError, check_space

    class Full:
        f_bavail, f_frsize = 100, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full)
    with pytest.raises(WriteError, match=r"needs about 2.0 MB and the file system holds "
                                         r"0.4 MB free"):
        check_space(tmp_path / "out.h5", 2_000_000)
    assert not list(tmp_path.iterdir())


def test_h5py_write_failures_are_one_error_not_a_traceback_per_object(tmp_path):
    """HDF5 reports a failed system write inside its message, as whichever type the call
    maps to; ``writing`` turns each into the one-line error."""
    from hpcpar.checkpoint.files import WriteError, writing
    for error in (RuntimeError("Unable to flush file (file write failed: time = ..., "
                               "errno = 28, error message = 'No space left on device')"),
                  ValueError("Unable to synchronously create dataset (file write failed: "
                             "errno = 122, error message = 'Disk quota exceeded')")):
        with pytest.raises(WriteError) as e, writing(tmp_path / "x.h5"):
            raise error
        assert str(e.value).startswith(f"cannot write {tmp_path / 'x.h5'}: ")
        assert "No space left" in str(e.value) or "quota" in str(e.value).lower()
    with pytest.raises(KeyError), writing(tmp_path / "x.h5"):     # not a write failure
        raise KeyError("tokens")
