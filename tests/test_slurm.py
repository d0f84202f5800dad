"""Slurm: the batch scripts ``hpcpar submit`` renders, and jobs run for real on a single-node
Slurm (slurmctld + slurmd + munge from the distribution's packages, started by
slurm/local-cluster.sh and stopped by their PIDs): the demo and a training job submitted with
``hpcpar submit``; a training job that gets the time-limit signal saves, requeues itself,
resumes and ends with the same files as an uninterrupted run.

Needs root and the distribution's packages (installed when absent): where the machine cannot
have them (not root, no apt-get, the install fails: slurm/local-cluster.sh's status 77) the
tests of a real Slurm are skipped with the script's reason; a Slurm that is there but does not
start fails them. CI runs as root after installing the packages (.ci/run), so there they run.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from helpers import REPO, losses, wait_for_steps
from hpcpar.jobs.slurm import SlurmRequest, render, static_scripts
from test_generate_cli import _assert_one_error

# processes of their own: the whole suite's tier, not tests/run --quick
pytestmark = pytest.mark.slow

CLUSTER = REPO / "slurm" / "local-cluster.sh"
SKIPPED = 77                # local-cluster.sh: this machine cannot have a local Slurm


def test_the_script_has_the_time_limit_pattern_and_resumes_training():
    script = render(SlurmRequest("jobs/train_tiny.toml", True, nodes=2, ranks_per_node=4,
                                 partition="gpu", account="proj", time="02:00:00"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --gpus-per-task=1", "#SBATCH --time=02:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "trap forward USR1",
                 'scontrol requeue "$SLURM_JOB_ID"', "--set train.resume=auto",
                 "HPCPAR_LAUNCH=${HPCPAR_LAUNCH:-srun --mpi=pmi2}"):
        assert line in script, line
    cpu = render(SlurmRequest("jobs/demo.toml", False, gpus_per_node=0))
    assert "--gpus-per-task" not in cpu and "train.resume" not in cpu
    assert "--set generate.resume=auto" in cpu
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_the_scripts_in_slurm_are_the_rendered_defaults():
    for name, text in static_scripts().items():
        assert (REPO / "slurm" / name).read_text() == text, name
        subprocess.run(["bash", "-n", str(REPO / "slurm" / name)], check=True)


def _submit(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "hpcpar", "submit", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ if env is None else env, PYTHONPATH=str(REPO)))


def test_submit_checks_the_layout_against_the_ranks_before_queueing(tmp_path):
    proc = _submit(str(REPO / "jobs" / "train_tiny.toml"), "--ranks-per-node", "3",
                   "--gpus-per-node", "0", "--dry-run", cwd=tmp_path)
    _assert_one_error(proc, "dp(1) * pp(2) * tp(2) = 4 != world size 3")
    proc = _submit(str(REPO / "jobs" / "demo.toml"), "--ranks-per-node", "4",
                   "--gpus-per-node", "2", "--dry-run", cwd=tmp_path)
    _assert_one_error(proc, "one rank per GPU")
    proc = _submit(str(REPO / "jobs" / "train_tiny.toml"), "--nodes", "2", "--ranks-per-node",
                   "4", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout and "train.resume=auto" in proc.stdout


# ---- a real Slurm ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm():
    # not under pytest's private temp root: munged runs as its own user and must reach it
    state = Path(tempfile.mkdtemp(prefix="hpcpar-slurm-"))
    state.chmod(0o711)
    up = subprocess.run(["bash", str(CLUSTER), "up", str(state)], capture_output=True,
                        text=True, timeout=300)
    if up.returncode == SKIPPED:
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(f"no local Slurm on this machine: {up.stderr.strip()}")
    if up.returncode:
        pytest.fail(f"could not start a local Slurm: {up.stderr.strip()}")
    env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"))
    yield env
    subprocess.run(["bash", str(CLUSTER), "down", str(state)], timeout=60)
    shutil.rmtree(state, ignore_errors=True)


def _scontrol(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                         text=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def _wait(env, job, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _scontrol(env, job).get("JobState")
        if state in ENDED:
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} did not end in {timeout} s")


def _why(env, job) -> str:
    """What Slurm says of ``job`` and the ends of its daemons' logs: the message of a job
    that did not end as the test expected."""
    state = Path(env["SLURM_CONF"]).parent
    logs = [f"{name}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:])
            for name in ("slurmctld.log", "slurmd.log") if (path := state / name).exists()]
    show = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                          text=True).stdout
    return "\n".join([show, *logs])


def _wait_for_the_restart(env, job, timeout=120):
    """A requeued job waits out its old credential's lifetime before it starts again
    (slurm/local-cluster.sh: 10 s), then for a pass of the scheduler (30 s apart). Once the
    job has been pending 2 s, start it now: a start within the second its old credential was
    revoked is refused ("Job credential revoked"), so never sooner. An update sent while the
    job is still being requeued is lost, so it is sent again until the job runs."""
    deadline = time.monotonic() + timeout
    pending_since = None
    while time.monotonic() < deadline:
        info = _scontrol(env, job)
        state = info.get("JobState")
        if info.get("Restarts") == "1" and state in ("RUNNING", *ENDED):
            return                                   # running again (or ended: _wait says)
        if info.get("Restarts") == "1" and state == "PENDING":
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since >= 2:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                               env=env, capture_output=True)
        time.sleep(0.5)
    raise AssertionError(f"job {job} was not requeued and started again in {timeout} s\n"
                         + _why(env, job))


def _job_id(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1]


TRAIN = ["--ranks-per-node", "2", "--gpus-per-node", "0", "--set", "parallel.pp=2",
         "--set", "parallel.tp=1", "--set", "parallel.micro_batches=2",
         "--set", "train.global_batch=8"]


def test_the_demo_and_a_training_job_run_through_hpcpar_submit(slurm, tmp_path):
    demo = _job_id(_submit(str(REPO / "jobs" / "demo.toml"), "--ranks-per-node", "4",
                           "--gpus-per-node", "0", "--set", "output.path='demo.h5'",
                           cwd=tmp_path, env=slurm))
    train = _job_id(_submit(str(REPO / "jobs" / "train_tiny.toml"), *TRAIN,
                            "--set", "train.steps=6", "--set", "output.path='run'",
                            cwd=tmp_path, env=slurm))
    assert _wait(slurm, demo) == "COMPLETED", (tmp_path / f"demo-{demo}.out").read_text()
    with h5py.File(tmp_path / "demo.h5") as f:
        assert f.attrs["pp"] == 2 and f["tokens"].shape[0] > 0
    log = (tmp_path / f"train_tiny-{train}.out")
    assert _wait(slurm, train) == "COMPLETED", log.read_text()
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-6.h5"
    assert "layout: dp 1 x pp 2 x tp 1" in log.read_text()


def test_the_time_limit_signal_saves_requeues_resumes_and_ends_as_an_uninterrupted_run(
        slurm, tmp_path):
    common = [*TRAIN, "--set", "train.steps=120", "--set", "train.optimizer='sgd'",
              "--set", "train.lr=0.01"]
    straight = _job_id(_submit(str(REPO / "jobs" / "train_tiny.toml"), *common,
                               "--set", "output.path='straight'", cwd=tmp_path, env=slurm))
    assert _wait(slurm, straight) == "COMPLETED", _why(slurm, straight)
    job = _job_id(_submit(str(REPO / "jobs" / "train_tiny.toml"), *common,
                          "--set", "output.path='stopped'", cwd=tmp_path, env=slurm))
    wait_for_steps(tmp_path / "stopped", 3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    _wait_for_the_restart(slurm, job)
    assert _wait(slurm, job) == "COMPLETED", _why(slurm, job)
    log = (tmp_path / f"train_tiny-{job}.out").read_text()
    assert "requeueing job" in log and "restart 1" in log, log
    stopped_at = int(log.split("stopped at step ")[1].split()[0])
    assert 3 <= stopped_at < 120
    got = losses(tmp_path / "stopped")
    assert len(got) == 120
    np.testing.assert_allclose(got, losses(tmp_path / "straight"), rtol=1e-6)
    with h5py.File(tmp_path / "stopped" / "step-120.h5") as a, \
            h5py.File(tmp_path / "straight" / "step-120.h5") as b:
        for name, dset in b.items():
            if isinstance(dset, h5py.Dataset):
                np.testing.assert_array_equal(a[name][()], dset[()], err_msg=name)


def test_a_generation_job_survives_the_time_limit_signal_with_the_same_output(slurm, tmp_path):
    common = ["--ranks-per-node", "2", "--gpus-per-node", "0", "--set", "parallel.pp=1",
              "--set", "parallel.tp=2", "--set", "data.random_count=200",
              "--set", "generate.wave_size=4", "--set", "generate.save_logits=true"]
    straight = _job_id(_submit(str(REPO / "jobs" / "demo.toml"), *common,
                               "--set", "output.path='straight.h5'", cwd=tmp_path, env=slurm))
    assert _wait(slurm, straight) == "COMPLETED", _why(slurm, straight)
    job = _job_id(_submit(str(REPO / "jobs" / "demo.toml"), *common,
                          "--set", "output.path='stopped.h5'", cwd=tmp_path, env=slurm))
    partial = tmp_path / ".stopped.h5.partial"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not partial.exists():
        time.sleep(0.02)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    _wait_for_the_restart(slurm, job)
    assert _wait(slurm, job) == "COMPLETED", _why(slurm, job)
    log = (tmp_path / f"demo-{job}.out").read_text()
    assert "stopped on request" in log and "requeueing job" in log and "restart 1" in log, log
    with h5py.File(tmp_path / "stopped.h5") as a, h5py.File(tmp_path / "straight.h5") as b:
        for name in ("tokens", "lengths", "prompt_logits"):
            np.testing.assert_array_equal(a[name][()], b[name][()], err_msg=name)
