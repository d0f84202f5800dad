"""Parity with torch itself: a tiny ``LlamaForCausalLM`` built by transformers, converted,
trained one SGD step and three AdamW steps by hpcpar and by torch (float32): the same loss,
gradient norm and weights.

Torch's side is what its users write: ``model(ids, labels=ids).loss``, ``backward()``,
``clip_grad_norm_``, and ``torch.optim.SGD`` / ``AdamW`` with weight decay on matrices only.
"""

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hpcpar.jobs import load_job  # noqa: E402
from hpcpar.train.engine import run_training  # noqa: E402
from helpers import HF_CONFIGS, build_hf_model  # noqa: E402

B, L = 4, 10


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf, _ = build_hf_model(request.param, folder)
    cfg = hf.config
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (3 * B, L + 1))
    np.save(folder / "data.npy", rows)
    return folder, rows


def _torch_run(folder, rows, steps, optimizer, **opts):
    hf = transformers.LlamaForCausalLM.from_pretrained(folder / "hf").float().train()
    decay = [p for p in hf.parameters() if p.ndim == 2]
    no_decay = [p for p in hf.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": opts["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=opts["lr"], momentum=opts["momentum"])
    else:
        opt = torch.optim.AdamW(groups, lr=opts["lr"], betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for s in range(steps):
        ids = torch.from_numpy(rows[s * B:(s + 1) * B])
        opt.zero_grad()
        loss = hf(ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), opts["clip"] or float("inf"))
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return hf, losses, norms


def _hpcpar_run(folder, out, steps, optimizer, **opts):
    sets = [f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/data.npy'",
            f"output.path='{folder}/{out}'", f"train.steps={steps}", f"train.global_batch={B}",
            f"train.optimizer='{optimizer}'", f"train.lr={opts['lr']}",
            f"train.momentum={opts['momentum']}", f"train.weight_decay={opts['weight_decay']}",
            f"train.clip_grad={opts['clip']}", "train.betas=[0.9, 0.95]",
            "train.peak_tflops=1.0"]
    run_training(MPI.COMM_SELF, load_job(None, sets), progress=False)
    metrics = [json.loads(line) for line in open(f"{folder}/{out}/metrics.jsonl")]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


def _weights(path):
    with h5py.File(path) as f:
        return {k: v[()] for k, v in f.items() if isinstance(v, h5py.Dataset)}


def test_one_sgd_step_matches_torch(model):
    folder, rows = model
    opts = dict(lr=0.5, momentum=0.9, weight_decay=0.1, clip=0.0)
    hf, losses, norms = _torch_run(folder, rows, 1, "sgd", **opts)
    got_losses, got_norms = _hpcpar_run(folder, "sgd", 1, "sgd", **opts)
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert got_norms == pytest.approx(norms, rel=1e-5)
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    mine = _weights(folder / "sgd/step-1.h5")
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert set(mine) == set(state) - tied          # a tied head is stored once, as HF does
    for name, w in mine.items():
        np.testing.assert_allclose(w, state[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_three_adamw_steps_with_clipping_match_torch(model):
    folder, rows = model
    opts = dict(lr=1e-3, momentum=0.0, weight_decay=0.1, clip=0.5)
    before = _weights(folder / "model.h5")
    hf, losses, norms = _torch_run(folder, rows, 3, "adamw", **opts)
    got_losses, got_norms = _hpcpar_run(folder, "adamw", 3, "adamw", **opts)
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert got_norms == pytest.approx(norms, rel=1e-5)
    assert max(norms) > opts["clip"]                     # clipping really happened
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for name, w in _weights(folder / "adamw/step-3.h5").items():
        update = np.linalg.norm(state[name] - before[name])
        assert np.linalg.norm(w - state[name]) <= 1e-3 * update, name
