"""``hpcpar train`` and training job files as users run them, under mpiexec in a subprocess:
the shipped tiny job learns, its checkpoint generates, bad input is one error with no
checkpoint written, and a job stopped by a signal resumes under another layout to the same
weights as a run that was never stopped."""

import json
import os
import signal

import h5py
import numpy as np
import pytest

from helpers import GQA, MPIEXEC, REPO, losses, make_checkpoint, mpirun, wait_for_steps
from test_generate_cli import _assert_one_error

# processes of their own: the whole suite's tier, not tests/run --quick
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_cli")
    make_checkpoint(folder, GQA)
    rows = np.random.default_rng(0).integers(0, GQA["vocab_size"], (64, 9))
    np.save(folder / "data.npy", rows)
    return folder


def _train(workdir, n, out, *extra, timeout=120):
    return mpirun(n, ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data",
                      "data.npy", "--steps", "2", "--global-batch", "8", "--out", out, *extra],
                  workdir, timeout=timeout)[0]


def test_the_tiny_job_learns_and_its_checkpoint_generates(workdir):
    proc, seconds = mpirun(8, ["-m", "hpcpar", "run", str(REPO / "jobs" / "train_tiny.toml")],
                           workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "layout: dp 2 x pp 2 x tp 2; schedule 1f1b, 4 micro-batch(es)" in proc.stdout
    metrics = [json.loads(line) for line in open(workdir / "train_tiny" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, 41))
    assert metrics[0]["loss"] > 5.0 and metrics[-1]["loss"] < 2.0
    for key in ("grad_norm", "lr", "tokens", "seconds", "tokens_per_s", "mfu"):
        assert all(m[key] > 0 for m in metrics), key
    assert (workdir / "train_tiny" / "latest").read_text().strip() == "step-40.h5"
    assert (workdir / "train_tiny" / "step-20.h5").exists()
    proc, _ = mpirun(2, ["-m", "hpcpar", "generate", "--checkpoint", "train_tiny/step-40.h5",
                         "--prompts", "random", "--max-new-tokens", "4", "--out", "gen.h5",
                         "--tp", "2"], workdir)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(workdir / "gen.h5") as f:
        assert f["tokens"].shape[1] == 4


@pytest.mark.parametrize("rows, flags, words", [
    ([[5, 250, 7]], [], "token id 250 >= vocab_size 250"),
    ([[5], [6]], [], "samples of 1 token(s); training needs at least 2"),
    (None, ["--global-batch", "6", "--dp", "2", "--micro-batches", "2"],
     "global batch 6 is not divisible by dp * micro_batches = 2 * 2 = 4"),
    (None, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
            "--micro-batches", "2"], "cuts the 9 layers into pp * virtual_stages = 4"),
    (None, ["--schedule", "interleaved", "--pp", "2", "--virtual-stages", "3",
            "--micro-batches", "3"], "micro_batches 3 is not a multiple of pp 2"),
    (None, ["--lr", "-1"], "lr must be >= 0"),
    (None, ["--lr", "0.001", "--min-lr", "0.1", "--lr-schedule", "cosine"],
     "min_lr 0.1 is above lr 0.001: the cosine schedule decays from lr to min_lr"),
    (None, ["--optimizer", "adamw", "--momentum", "0.9"],
     "momentum 0.9 is SGD's setting and AdamW takes none"),
])
def test_bad_training_input_is_one_error_and_no_checkpoint(workdir, rows, flags, words):
    data = ["--data", "data.npy"]
    if rows is not None:
        np.save(workdir / "bad.npy", np.array(rows))
        data = ["--data", "bad.npy"]
    proc = _train(workdir, 2, "bad_out", *flags, *data)
    _assert_one_error(proc, words)
    assert not (workdir / "bad_out").exists()


def test_resuming_from_another_model_is_refused(workdir):
    proc = _train(workdir, 1, "other_model", "--steps", "1")
    assert proc.returncode == 0, proc.stderr
    other = make_checkpoint(workdir / "other", dict(GQA, intermediate_size=96))[0]
    proc = mpirun(1, ["-m", "hpcpar", "train", "--checkpoint", str(other), "--data",
                      "data.npy", "--steps", "2", "--global-batch", "8", "--out",
                      "other_model", "--resume", "auto"], workdir)[0]
    _assert_one_error(proc, "its model differs from --checkpoint")
    assert not (workdir / "other_model" / "step-2.h5").exists()


def test_a_diverging_run_stops_at_the_bad_step_and_keeps_the_last_good_checkpoint(workdir):
    proc = _train(workdir, 2, "diverge", "--steps", "4", "--save-every", "1", "--optimizer",
                  "sgd", "--lr", "1e30", "--dp", "2")
    _assert_one_error(proc, "step 2: loss is")
    assert "the last good checkpoint is diverge/step-1.h5" in proc.stderr
    assert (workdir / "diverge" / "latest").read_text().strip() == "step-1.h5"
    assert not (workdir / "diverge" / "step-2.h5").exists()


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children + [d for c in children for d in _descendants(c)]


def test_a_signal_stops_at_a_step_boundary_and_the_run_resumes_under_another_layout(workdir):
    steps = 80                     # the signal comes after step 3: dozens of steps later is the end
    common = ["--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9", "--global-batch",
              "4", "--shuffle", "--seed", "3"]
    straight = _train(workdir, 1, "straight", *common, "--steps", str(steps))
    assert straight.returncode == 0, straight.stderr

    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    args = [MPIEXEC, "-n", "2", sys.executable, "-m", "hpcpar", "train", "--checkpoint",
            "model.h5", "--data", "data.npy", "--out", "stopped", "--dp", "2", "--steps",
            str(steps), *common]
    proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_steps(workdir / "stopped", 3, timeout=60)
    ranks = [p for p in _descendants(proc.pid)
             if b"hpcpar" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert ranks, "no rank process found"
    os.kill(ranks[-1], signal.SIGTERM)                      # one rank hears it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    stopped_at = int((workdir / "stopped" / "latest").read_text().strip()[5:-3])
    assert 3 <= stopped_at < steps
    assert f"stopped at step {stopped_at} on request" in out

    resumed = mpirun(2, ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data",
                         "data.npy", "--out", "stopped", "--tp", "2", "--steps", str(steps),
                         "--resume", "auto", *common], workdir, timeout=120)[0]
    assert resumed.returncode == 0, resumed.stderr
    got = losses(workdir / "stopped")
    assert len(got) == steps
    np.testing.assert_allclose(got, losses(workdir / "straight"), rtol=1e-4)
    with h5py.File(workdir / "stopped" / f"step-{steps}.h5") as a, \
            h5py.File(workdir / "straight" / f"step-{steps}.h5") as b:
        for name, dset in b.items():
            if isinstance(dset, h5py.Dataset):
                # float32 steps summed in other orders: normwise per tensor
                got, want = a[name][()], dset[()]
                assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), name
            else:
                assert set(a[name]) == set(dset)


@pytest.mark.parametrize("flags, words", [
    (["--dp", "2", "--micro-batches", "4", "--global-batch", "4"],
     "global batch 4 is not divisible by dp * micro_batches = 2 * 4 = 8"),
    (["--dp", "2", "--zero", "3", "--set", "train.lora_rank=4"],
     "a LoRA run trains only its small adapters"),
    (["--dp", "2", "--sequence-parallel"], "--sequence-parallel splits each sequence over"),
])
def test_plan_refuses_what_train_refuses(workdir, flags, words):
    """A training plan of a job train would refuse is that refusal, one line, exit 2: not a
    plan of micro-batches of 0 rows."""
    proc, _ = mpirun(1, ["-m", "hpcpar", "plan", "--checkpoint", "model.h5", "--train",
                         "--world", "2", *flags], workdir)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1 and words in errors[0], proc.stderr


@pytest.mark.parametrize("where", ["hf", "hf/config.json"])
def test_plan_reads_a_hugging_face_config_without_its_weights(workdir, where):
    """The config.json the checkpoint was converted from (or its folder) plans alike: the
    same lines but the model's name, for generation and training."""
    for mode in ([], ["--train", "--dp", "2", "--zero", "3"]):
        plans = []
        for source in (where, "model.h5"):
            proc, _ = mpirun(1, ["-m", "hpcpar", "plan", "--checkpoint", source, *mode],
                             workdir)
            assert proc.returncode == 0, proc.stderr
            plans.append(proc.stdout.splitlines()[1:])
        assert plans[0] == plans[1]


def test_plan_shows_training_memory_bubble_and_the_zero_bubble_timeline(workdir):
    proc, _ = mpirun(1, ["-m", "hpcpar", "plan", "--checkpoint", "model.h5", "--train",
                         "--pp", "3", "--micro-batches", "4", "--schedule", "zb-h1",
                         "--global-batch", "8", "--seq-len", "16"], workdir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "zb-h1 with 4 micro-batch(es) of 2 x 16 tokens" in out
    assert "pipeline bubble: 14.3% by the zb-h1 formula" in out      # 2 / (3 * 4 + 2)
    assert "stage 0: F0 F1 F2" in out and "W3" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("0 ", "1 ", "2 ")]
    assert [r[1] for r in rows] == ["0-2", "3-5", "6-8"]
    proc, _ = mpirun(1, ["-m", "hpcpar", "plan", str(REPO / "jobs" / "train_100m.toml"),
                         "--world", "8"], workdir)
    assert proc.returncode == 0 and "recompute full" in proc.stdout, proc.stderr
    optimizer_mb = {}
    for zero in ("0", "1"):
        proc, _ = mpirun(1, ["-m", "hpcpar", "plan", "--checkpoint", "model.h5", "--train",
                             "--dp", "4", "--zero", zero, "--global-batch", "8"], workdir)
        assert proc.returncode == 0, proc.stderr
        row = next(line.split() for line in proc.stdout.splitlines()
                   if line.strip().startswith("0 "))
        scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
        optimizer_mb[zero] = float(row[5]) * scale[row[6]]       # the optimizer column
    # AdamW's two states over the 4 replicas, with the float32 weights of each one's piece
    assert optimizer_mb["1"] == pytest.approx(optimizer_mb["0"] * 3 / 2 / 4, rel=0.01)
