"""Training checks the room a checkpoint needs before its first step: a disk without room
is one error before any step runs, with no run folder and no metrics.jsonl left behind
(it used to train every step and fail at the first save)."""

import os

import numpy as np
import pytest
from mpi4py import MPI

from helpers import GQA, make_checkpoint
from hpcpar.jobs.job import load_job
from hpcpar.jobs.launch import EXIT_INVALID, JobFailed
from hpcpar.jobs.train import checkpoint as tc
from hpcpar.jobs.train.engine import run_training


def _job(folder, out):
    return load_job(None, [f"model.checkpoint='{folder}/model.h5'",
                           f"data.dataset='{folder}/data.npy'", f"output.path='{folder}/{out}'",
                           "train.global_batch=8", "train.steps=2", "train.peak_tflops=1.0"])


def test_a_disk_without_room_for_a_checkpoint_stops_training_before_step_one(
        tmp_path, monkeypatch, capsys):
    make_checkpoint(tmp_path, dict(GQA, num_hidden_layers=2))
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, GQA["vocab_size"],
                                                                     (16, 9)))
    from hpcpar.checkpoint import open_checkpoint
    needed = tc.checkpoint_bytes(open_checkpoint(tmp_path / "model.h5"),
                                 ("exp_avg", "exp_avg_sq"))
    real = os.statvfs

    class Almost:                          # room for a little less than one checkpoint
        f_frsize, f_bavail = 1, needed // 2

    monkeypatch.setattr(os, "statvfs", lambda path: Almost if str(path).startswith(
        str(tmp_path)) else real(path))
    with pytest.raises(JobFailed) as failed:
        run_training(MPI.COMM_SELF, _job(tmp_path, "run"), progress=False)
    assert failed.value.code == EXIT_INVALID
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "run/step-1.h5: it needs about" \
        in err[0], err
    assert not (tmp_path / "run").exists()
