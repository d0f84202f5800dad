"""Mixed precision: bfloat16 and float16 compute over float32 master weights, and float16's
dynamic loss scaling (skip the step and halve the scale on overflow, resume with it)."""

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import GQA, make_checkpoint
from hpcpar.jobs.job import load_job
from hpcpar.jobs.train.engine import run_training


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("precision")
    make_checkpoint(folder, dict(GQA, num_hidden_layers=2))
    rows = np.random.default_rng(2).integers(0, GQA["vocab_size"], (32, 9))
    np.save(folder / "data.npy", rows)
    return folder


def _train(folder, out, dtype, *sets):
    job = load_job(None, [f"model.checkpoint='{folder}/model.h5'", f"model.dtype='{dtype}'",
                          f"data.dataset='{folder}/data.npy'", f"output.path='{folder}/{out}'",
                          "train.global_batch=8", "train.optimizer='sgd'", "train.lr=0.5",
                          "train.steps=2", "train.peak_tflops=1.0", *sets])
    run_training(MPI.COMM_SELF, job, progress=False)
    return [json.loads(line) for line in open(folder / out / "metrics.jsonl")]


def _weights(path):
    with h5py.File(path) as f:
        return {k: v[()] for k, v in f.items() if isinstance(v, h5py.Dataset)}


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_steps_follow_the_float32_steps(folder, dtype):
    ref = _train(folder, "fp32", "float32")
    got = _train(folder, dtype, dtype)
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=2e-3)
    assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=3e-2)
    before, w32 = _weights(folder / "model.h5"), _weights(folder / "fp32" / "step-2.h5")
    w16 = _weights(folder / dtype / "step-2.h5")
    for name, w in w16.items():
        assert w.dtype == np.float32, name                  # master weights stay float32
        update = w32[name] - before[name]
        assert np.linalg.norm(w - w32[name]) <= 0.1 * np.linalg.norm(update) + 1e-7, name


@pytest.mark.device
def test_float16_overflow_skips_the_step_halves_the_scale_and_resumes_with_it(folder):
    metrics = _train(folder, "scaled", "float16", "train.loss_scale=16777216.0", "train.steps=3",
                     "train.save_every=1")
    first = metrics[0]
    assert first["grad_norm"] is None and first["loss_scale"] == 2.0 ** 23      # skipped, halved
    with h5py.File(folder / "scaled" / "step-1.h5") as f:
        assert dict(f["train"].attrs)["optimizer_steps"] == 0
        np.testing.assert_array_equal(f["model.norm.weight"][()],
                                      _weights(folder / "model.h5")["model.norm.weight"])
    scales = [m["loss_scale"] for m in metrics]
    assert scales == sorted(scales, reverse=True)
    resumed = _train(folder, "scaled", "float16", "train.loss_scale=16777216.0", "train.steps=8",
                     "train.resume='auto'")
    assert resumed[3]["loss_scale"] <= scales[-1]           # the scale came from the checkpoint
    ok = [m for m in resumed if m["grad_norm"] is not None]
    assert ok, "the scale never came down far enough for a step to run"


def _torch_scales(start: float, window: int, overflows: list[bool]) -> list[float]:
    """The scale after each step by torch's own update (``torch.amp.GradScaler``'s kernel:
    halve on an overflow, double after ``window`` good steps in a row)."""
    torch = pytest.importorskip("torch")
    scale = torch.tensor([start], dtype=torch.float32)
    tracker = torch.zeros(1, dtype=torch.int32)
    out = []
    for overflow in overflows:
        found = torch.tensor([1.0 if overflow else 0.0])
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, window)
        out.append(float(scale))
    return out


def test_the_loss_scaler_follows_torchs_grad_scaler():
    from hpcpar.parallel.optim.optimizers import LossScaler
    rng = np.random.default_rng(3)
    overflows = list(rng.random(60) < 0.15)
    scaler, got = LossScaler(2.0 ** 10, growth_interval=3), []
    for overflow in overflows:
        scaler.update(bool(overflow))
        got.append(scaler.scale)
    assert got == _torch_scales(2.0 ** 10, 3, overflows)
    assert max(got) > 2.0 ** 10 and min(got) < 2.0 ** 10      # it grew and it fell


@pytest.mark.device
def test_float16_scale_grows_after_the_window_of_good_steps(folder):
    """No overflow at a scale of 1: the scale doubles after every second good step, as
    torch's scaler would have it; the steps are not skipped."""
    metrics = _train(folder, "growth", "float16", "train.loss_scale=1.0",
                     "train.loss_scale_window=2", "train.steps=5")
    assert all(m["grad_norm"] is not None for m in metrics)
    assert [m["loss_scale"] for m in metrics] == _torch_scales(1.0, 2, [False] * 5)
    assert metrics[-1]["loss_scale"] == 4.0


@pytest.mark.device
def test_mfu_is_the_model_flops_counted_by_hand_over_the_peak(folder):
    """MFU = tokens/s x (6 N + 12 L d T) / peak, N the matrices' parameters (the input
    embedding left out unless it is tied to the head), counted here from the config."""
    cfg = dict(GQA, num_hidden_layers=2)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    matrices = layers * per_layer + cfg["vocab_size"] * h          # the head, untied
    T = 8                                                           # rows of 9 tokens
    per_token = 6 * matrices + 12 * layers * h * T
    metrics = _train(folder, "mfu", "float32", "train.peak_tflops=0.5")
    for m in metrics:
        assert m["mfu"] == pytest.approx(m["tokens_per_s"] * per_token / 0.5e12, rel=1e-9)
