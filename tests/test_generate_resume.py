"""Preemption-safe generation: a signal stops the job within a step (no waves needed) with
status 3 and no output file, keeping every prompt finished by then (and with waves, each
wave's results as it ends); ``--resume auto`` runs only the rest, and the output equals an
uninterrupted run's."""

import os
import signal
import subprocess
import sys
import time

import json

import h5py
import numpy as np
import pytest

from helpers import GQA, MPIEXEC, REPO, make_checkpoint, mpirun
from test_generate_cli import _assert_one_error
from test_train_cli import _descendants


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    make_checkpoint(folder, GQA)
    rng = np.random.default_rng(4)
    np.save(folder / "many.npy", rng.integers(3, 250, (PROMPTS, 6)))
    return folder


PROMPTS = 100                  # 50 waves of 2: the stop comes after the first
ARGS = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts", "many.npy",
        "--max-new-tokens", "6", "--save-logits", "--ignore-eos", "--dp", "2"]


def _read(path):
    with h5py.File(path) as f:
        return {k: f[k][()] for k in ("tokens", "lengths", "prompt_logits")}


@pytest.mark.slow
def test_waves_give_the_tokens_of_one_wave_and_leave_no_partial_file(work):
    one = mpirun(2, [*ARGS, "--out", "one.h5"], work)[0]
    waves = mpirun(2, [*ARGS, "--out", "waves.h5", "--wave-size", "10"], work)[0]
    assert one.returncode == 0 and waves.returncode == 0, one.stderr + waves.stderr
    a, b = _read(work / "one.h5"), _read(work / "waves.h5")
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_allclose(a["prompt_logits"], b["prompt_logits"], atol=1e-4)
    assert not (work / ".waves.h5.partial").exists()


@pytest.mark.slow
def test_a_stopped_generation_resumes_to_the_uninterrupted_file(work):
    straight = mpirun(2, [*ARGS, "--out", "straight.h5", "--wave-size", "2"], work,
                      timeout=300)[0]
    assert straight.returncode == 0, straight.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_CACHE=str(work / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, *ARGS, "--out", "stopped.h5",
                             "--wave-size", "2"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    partial = work / ".stopped.h5.partial"
    _wait_for_a_saved_wave(partial, time.monotonic() + 60)
    ranks = [p for p in _descendants(proc.pid)
             if b"hpcpar" in open(f"/proc/{p}/cmdline", "rb").read()]
    os.kill(ranks[0], signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "stopped on request" in out and not (work / "stopped.h5").exists()
    with h5py.File(partial) as f:
        done = int(f["done"][()].sum())
    assert 0 < done < PROMPTS
    resumed = mpirun(2, [*ARGS, "--out", "stopped.h5", "--wave-size", "2", "--resume",
                         "auto"], work, timeout=300)[0]
    assert resumed.returncode == 0, resumed.stderr
    assert f"{PROMPTS - done} prompts" in resumed.stdout            # only the rest ran
    a, b = _read(work / "straight.h5"), _read(work / "stopped.h5")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert not partial.exists()


def _wait_for_a_saved_wave(partial, deadline: float) -> None:
    """Until the running job's partial file holds a finished wave: a signal within the first
    wave would leave nothing saved (a fixed sleep after the file appeared was too short on a
    loaded machine, one run in four). Read without HDF5's lock, retried while it is written."""
    while time.monotonic() < deadline:
        try:
            with h5py.File(partial, "r", locking=False) as f:
                if int(f["done"][()].sum()) > 0:
                    return
        except (OSError, KeyError):            # not there yet, or caught mid-write
            pass
        time.sleep(0.01)
    raise AssertionError(f"no wave saved in {partial} within the time allowed")


@pytest.mark.slow
def test_resuming_with_other_settings_is_refused(work):
    partial = work / ".other.h5.partial"
    with h5py.File(partial, "w") as f:
        f.attrs["run"] = "{}"
    proc = mpirun(2, [*ARGS, "--out", "other.h5", "--wave-size", "2", "--resume", "auto"],
                  work)[0]
    _assert_one_error(proc, "a stopped run with other settings")
    assert partial.exists() and not (work / "other.h5").exists()


def _signal_all_ranks(proc, sig) -> None:
    """As a scheduler does: every process of the job (the rank keepers pass it on too)."""
    for pid in _descendants(proc.pid):
        try:
            if b"hpcpar" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(pid, sig)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.mark.slow
def test_a_signal_mid_run_stops_within_steps_and_resumes_to_the_same_tokens(work):
    """One wave, a pipeline of 2 stages, rows with limits from 1 to 80 new tokens: SIGUSR1
    soon after the start stops the run with some rows finished (the short ones) and others
    not; the resumed run finishes those alone, to the uninterrupted run's tokens."""
    rng = np.random.default_rng(5)
    count = 120
    lines = [json.dumps({"ids": rng.integers(3, 250, int(rng.integers(2, 9))).tolist(),
                         "max_new_tokens": int(k)}) for k in rng.integers(1, 81, count)]
    (work / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    args = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts", "mixed.jsonl",
            "--max-new-tokens", "80", "--ignore-eos", "--pp", "2", "--micro-batches", "4"]
    straight, seconds = mpirun(2, [*args, "--out", "mixed_straight.h5"], work, timeout=300)
    assert straight.returncode == 0, straight.stderr
    print(f"uninterrupted: {seconds:.1f} s")
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_CACHE=str(work / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env["HPCPAR_PROGRESS_SECONDS"] = env["HPCPAR_SAVE_SECONDS"] = "0.05"  # rows seen soon
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, *args, "--out",
                             "mixed.h5"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:             # the progress log: rows have finished
        seen.append(line)
        if line.startswith("progress:") and int(line.split()[1].split("/")[0]) > 0:
            break
    _signal_all_ranks(proc, signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    partial = work / ".mixed.h5.partial"
    assert proc.returncode == 3, err
    assert "stopped on request" in out and not (work / "mixed.h5").exists()
    with h5py.File(partial) as f:
        done = f["done"][()]
    assert 0 < done.sum() < count, err                 # short rows kept, long ones not
    resumed = mpirun(2, [*args, "--out", "mixed.h5", "--resume", "auto"], work,
                     timeout=300)[0]
    assert resumed.returncode == 0, resumed.stderr
    assert f"{count - int(done.sum())} prompts" in resumed.stdout    # only the rest ran
    with h5py.File(work / "mixed_straight.h5") as a, h5py.File(work / "mixed.h5") as b:
        for key in ("tokens", "lengths"):
            np.testing.assert_array_equal(a[key][()], b[key][()], err_msg=key)
    assert not partial.exists()


@pytest.mark.slow
def test_rows_reach_the_partial_file_as_they_finish_and_survive_a_killed_job(work):
    """Two replicas; replica 1's rows and half of replica 0's want a few tokens, the rest 60.
    Rank 0 is killed outright (SIGKILL: no stop path runs) at decode step 30: the partial
    file holds every short row, replica 1's sent over while the run went on, and the
    resumed run ends with the uninterrupted run's file."""
    rng = np.random.default_rng(6)
    limits = [2] * 4 + [60] * 4 + [3] * 8               # rows 0-7: replica 0, 8-15: replica 1
    lines = [json.dumps({"ids": rng.integers(3, 250, int(rng.integers(2, 9))).tolist(),
                         "max_new_tokens": k}) for k in limits]
    (work / "killed.jsonl").write_text("\n".join(lines) + "\n")
    args = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts",
            "killed.jsonl", "--max-new-tokens", "60", "--ignore-eos", "--dp", "2"]
    straight = mpirun(2, [*args, "--out", "killed_straight.h5"], work, timeout=300)[0]
    assert straight.returncode == 0, straight.stderr
    os.environ.update(HPCPAR_FAULT="rank=0,phase=decode,step=30,kind=kill",
                      HPCPAR_SAVE_SECONDS="0")
    try:
        killed = mpirun(2, [*args, "--out", "killed.h5"], work, timeout=300)[0]
    finally:
        del os.environ["HPCPAR_FAULT"], os.environ["HPCPAR_SAVE_SECONDS"]
    assert killed.returncode != 0 and "was killed by SIGKILL" in killed.stderr, killed.stderr
    partial = work / ".killed.h5.partial"
    with h5py.File(partial) as f:
        done = f["done"][()]
        np.testing.assert_array_equal(np.flatnonzero(done), [0, 1, 2, 3, *range(8, 16)])
        with h5py.File(work / "killed_straight.h5") as a:
            np.testing.assert_array_equal(f["tokens"][()][done], a["tokens"][()][done])
    resumed = mpirun(2, [*args, "--out", "killed.h5", "--resume", "auto"], work,
                     timeout=300)[0]
    assert resumed.returncode == 0, resumed.stderr
    assert "4 prompts" in resumed.stdout, resumed.stdout            # only the long rows ran
    with h5py.File(work / "killed_straight.h5") as a, h5py.File(work / "killed.h5") as b:
        for key in ("tokens", "lengths"):
            np.testing.assert_array_equal(a[key][()], b[key][()], err_msg=key)
    assert not partial.exists()


@pytest.mark.slow
def test_a_damaged_partial_file_is_one_clear_error(work):
    partial = work / ".damaged.h5.partial"
    partial.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    proc = mpirun(2, [*ARGS, "--out", "damaged.h5", "--resume", "auto"], work)[0]
    _assert_one_error(proc, "cannot resume from it")
    assert partial.exists() and not (work / "damaged.h5").exists()


@pytest.mark.parametrize("logprobs", [(-1, -1), (3, -1), (0, 2)])
def test_a_finished_rows_message_unpacks_to_what_was_packed(logprobs):
    """Every array of the rows, the log-probabilities' floats bit for bit (NaN included)."""
    from hpcpar.jobs.generate.results import ResultShape, RowResults
    shape = ResultShape(5, *logprobs, prompt_width=4 if logprobs[1] >= 0 else 0)
    rng = np.random.default_rng(0)
    rows = RowResults.empty(3, shape, pad_id=2)
    for name, values in rows.arrays.items():
        if values.dtype.kind == "f":
            values[:] = rng.normal(size=values.shape).astype(values.dtype)
            values.reshape(-1)[::3] = np.nan
        else:
            values[:] = rng.integers(-1, 1000, values.shape)
    prompts = np.array([7, 2, 11])
    got_prompts, got = RowResults.unpack(rows.pack(prompts), shape)
    np.testing.assert_array_equal(got_prompts, prompts)
    assert set(got.arrays) == set(rows.arrays) == set(shape.specs())
    for name, values in rows.arrays.items():
        assert got.arrays[name].dtype == values.dtype
        np.testing.assert_array_equal(got.arrays[name], values, err_msg=name)
    got_prompts, got = RowResults.unpack(rows.take(slice(0, 0)).pack(prompts[:0]), shape)
    assert len(got_prompts) == len(got) == 0 and got.tokens.shape == (0, 5)


@pytest.mark.slow
def test_a_signal_to_a_rank_of_another_node_stops_the_generation_within_steps(work):
    """Two (fake) nodes, one rank each, a pipeline of 2 stages: SIGTERM to the last stage
    alone reaches the first stage, on the other node, as a message (it used to learn only
    at the end of the wave: every row was finished); the run stops with rows left."""
    rng = np.random.default_rng(6)
    count = 300
    lines = [json.dumps({"ids": rng.integers(3, 250, 4).tolist(), "max_new_tokens": 80})
             for _ in range(count)]
    (work / "long.jsonl").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_CACHE=str(work / "cache"),
               HPCPAR_PROGRESS_SECONDS="0.05", HPCPAR_FAKE_NODES="2",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "hpcpar", "generate",
                             "--checkpoint", "model.h5", "--prompts", "long.jsonl",
                             "--max-new-tokens", "80", "--ignore-eos", "--pp", "2",
                             "--micro-batches", "4",
                             "--timeout", "30", "--out", "long.h5"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:             # the progress log: the steps have started
        seen.append(line)
        if line.startswith("progress:"):
            break
    last_stage = [p for p in _descendants(proc.pid)
                  if b"hpcpar" in open(f"/proc/{p}/cmdline", "rb").read()
                  and b"PMI_RANK=1" in open(f"/proc/{p}/environ", "rb").read()
                  and b"HPCPAR_SUPERVISED_FD" in open(f"/proc/{p}/environ", "rb").read()]
    assert last_stage, "".join(seen)
    os.kill(last_stage[0], signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 3, err
    assert "stopped" in out and "on request (SIGTERM to rank 1)" in out, out + err
    with h5py.File(work / ".long.h5.partial") as f:
        done = int(f["done"][()].sum())
    assert done < count, err                          # stopped within the wave
