"""Packing (``--pack``): samples several to a row, each a document of its own.

The rows: first-fit in data order within a window, the same whatever the layout; a .bin cut
into documents after each EOS. Exact: two AdamW steps on packed rows give transformers'
losses, gradient norms and weights with each sample run apart (the sum of every sample's
token losses over the labels of the whole batch), for three families on one rank (Llama with
GQA, Mistral's window, Gemma 2's window and soft caps), and under tp 2 x pp 2 and dp 2 x cp 2
(4 ranks). Bad input is one line naming the sample, exit 2, before any work."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.jobs.train.packing import documents_of, first_fit, pack

L = 16                                      # positions per row
# samples' lengths: 20 is cut to L + 1 = 17 tokens (--long-rows cut); 4 rows, each step all
LENGTHS = [7, 12, 5, 9, 3, 20, 6, 4, 8, 2]
EPS = 1e-6
OPTS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


# ---- the rows ----------------------------------------------------------------------------

def test_first_fit_fills_the_first_row_with_room_in_data_order_within_the_window():
    assert first_fit([6, 11, 4, 8, 2, 16, 5], 16) == [[0, 2, 4], [1, 6], [3], [5]]
    # a window of 3: the fourth sample never reaches the first window's rows
    assert first_fit([6, 11, 4, 2], 16, window=3) == [[0, 2], [1], [3]]


def test_a_packed_row_holds_each_samples_inputs_and_labels_and_where_it_starts():
    a = np.array([10, 11, 12]), np.array([-1, 11, 12])
    b = np.array([20, 21]), np.array([20, 21])
    rows = pack([a, b], 5)
    # inputs 10 11 | 20 and one free position (left padding), the last token after them
    assert rows.samples.tolist() == [[-1, -1, 10, 11, 20, 21]]
    assert rows.labels.tolist() == [[-1, -1, -1, 11, 12, 21]]     # labels[1:]: 11 12 | 21
    assert rows.starts.tolist() == [[0, 0, 2, 3, 3]]           # real inputs first, padding 3
    assert rows.fill == pytest.approx(3 / 5)


def test_a_token_file_is_cut_into_documents_after_each_eos():
    docs = documents_of(np.array([5, 6, 2, 7, 2, 2, 8, 9]), eos=2)
    assert [d.tolist() for d in docs] == [[5, 6, 2], [7, 2], [2], [8, 9]]


# ---- exact: packed rows train as their samples one by one --------------------------------

def _samples(rng, vocab: int) -> list[dict]:
    lines = []
    for k, n in enumerate(LENGTHS):
        ids = rng.integers(3, vocab - 1, n).tolist()
        labels = [-100] * (k % 3) + ids[k % 3:]                     # some prompts masked
        lines.append({"ids": ids, "labels": labels})
    lines.insert(4, {"ids": [5, 6, 7], "labels": [-100] * 3})       # nothing to learn
    return lines


def _model(family: str) -> Path:
    from helpers import build_hf_model, made_once

    def build(folder):
        hf, _ = build_hf_model(family, folder)
        lines = _samples(np.random.default_rng(1), hf.config.vocab_size)
        (folder / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return made_once(f"test_packing {family}", build)


def _reference(folder: Path, steps: int):
    """transformers on each sample apart (cut to L + 1 tokens): the step's loss is the sum
    of the token losses over the batch's labels, AdamW with decay on matrices."""
    import torch
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").float().train()
    before = {n: p.detach().clone().numpy() for n, p in hf.state_dict().items()}
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": OPTS["weight_decay"]},
              {"params": [p for p in hf.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPTS["lr"], betas=OPTS["betas"], eps=EPS)
    samples = [json.loads(x) for x in (folder / "data.jsonl").read_text().splitlines()]
    samples = [(torch.tensor(s["ids"][:L + 1]), torch.tensor(s["labels"][:L + 1]))
               for s in samples]
    count = sum(int((lab[1:] != -100).sum()) for _, lab in samples)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for ids, labels in samples:
            logits = hf(ids[None]).logits[0, :-1]
            total = total + torch.nn.functional.cross_entropy(
                logits, labels[1:], ignore_index=-100, reduction="sum")
        loss = total / count
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(hf.parameters(), float("inf")).item())
        opt.step()
        losses.append(loss.item())
    after = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
    return losses, norms, before, after, count


def _train(comm, folder: Path, out: Path, steps: int, *layout: str):
    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.train.engine import run_training
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/data.jsonl'",
        f"output.path='{out}'", f"train.steps={steps}", "train.global_batch=4",
        f"train.seq_len={L}", "train.long_rows='cut'", "train.pack=true",
        "train.optimizer='adamw'", f"train.lr={OPTS['lr']}", "train.betas=[0.9, 0.95]",
        f"train.eps={EPS}", f"train.weight_decay={OPTS['weight_decay']}",
        "train.peak_tflops=1.0", *layout])
    return run_training(comm, job, progress=False)


def _assert_as_transformers(folder: Path, out: Path, report, steps: int) -> None:
    losses, norms, before, after, count = _reference(folder, steps)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], norms, rtol=1e-5)
    assert [m["loss_tokens"] for m in metrics] == [count] * steps
    # each step reads every row: the samples' inputs over 4 rows of L positions
    inputs = sum(min(n, L + 1) - 1 for n in LENGTHS)
    assert [m["fill"] for m in metrics] == [pytest.approx(inputs / (4 * L))] * steps
    with h5py.File(out / f"step-{steps}.h5") as f:
        for name, dset in f.items():
            if isinstance(dset, h5py.Dataset):
                moved = np.linalg.norm(after[name] - before[name])
                assert np.linalg.norm(dset[()] - after[name]) <= 1e-3 * moved, name
    assert "packed 10 samples into 4 rows of 16 positions" in report.data, report.data
    assert "1 row cut" in report.data and "1 row with nothing to learn skipped" in report.data


@pytest.mark.parametrize("family", ["gqa-llama3", "mistral", "gemma2"])
def test_packed_rows_train_as_their_samples_apart_in_transformers(tmp_path, family):
    pytest.importorskip("transformers")
    folder = _model(family)
    report = _train(MPI.COMM_SELF, folder, tmp_path / "run", 2, "parallel.micro_batches=2")
    _assert_as_transformers(folder, tmp_path / "run", report, 2)


@pytest.mark.mpi(ranks=(4,))
@pytest.mark.parametrize("layout", ["tp2-pp2", "dp2-cp2"])
def test_packed_rows_under_tp_pp_and_dp_cp_are_transformers(tmp_path_factory, layout):
    pytest.importorskip("transformers")
    comm = MPI.COMM_WORLD
    folder = out = None
    if comm.Get_rank() == 0:
        folder, out = _model("gqa-llama3"), tmp_path_factory.mktemp("pack-mpi") / "run"
    folder, out = (Path(p) for p in comm.bcast((str(folder), str(out)), root=0))
    sets = (["parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"]
            if layout == "tp2-pp2" else ["parallel.dp=2", "parallel.cp=2"])
    report = _train(comm, folder, out, 2, *sets)
    if comm.Get_rank() == 0:
        _assert_as_transformers(folder, out, report, 2)
    comm.Barrier()


# ---- bad input ---------------------------------------------------------------------------

def test_a_sample_longer_than_a_row_is_refused_naming_it_before_any_work(tmp_path):
    from helpers import hpcpar_here
    folder = _model("gqa-llama3")
    done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data",
                        folder / "data.jsonl", "--seq-len", str(L), "--pack", "--steps", "1",
                        "--global-batch", "2", "--out", tmp_path / "out"], tmp_path)
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and f"{folder / 'data.jsonl'}:7: the row has 20 tokens" \
        in errors[0] and "--long-rows cut" in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_data_it_cannot_pack_is_one_line(tmp_path):
    from helpers import hpcpar_here
    folder = _model("gqa-llama3")                        # (a model without an EOS)
    np.arange(3, 40, dtype=np.uint16).tofile(tmp_path / "docs.bin")
    for data, words in (("synthetic", "--pack: synthetic data has no samples of its own"),
                        (tmp_path / "docs.bin", "docs.bin: --pack cuts a token file into "
                                                "documents after each EOS, and this model "
                                                "has no eos_token_id")):
        done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data", data,
                            "--seq-len", str(L), "--pack", "--steps", "1", "--global-batch",
                            "2", "--out", tmp_path / "out"], tmp_path)
        errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(errors) == 1 and words in errors[0], done.stderr


def test_a_token_files_documents_are_packed_and_a_long_one_named(tmp_path):
    from dataclasses import replace

    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.jobs.train.data import load_dataset
    from hpcpar.parallel.errors import HpcparError
    cfg = replace(open_checkpoint(_model("gqa-llama3") / "model.h5").config, eos_token_id=(2,))
    tokens = np.concatenate([[5, 6, 2], np.full(19, 7), [2], [8, 9, 10, 2]])
    tokens.astype(np.uint16).tofile(tmp_path / "docs.bin")
    with pytest.raises(HpcparError, match=r"docs.bin: document 2 \(from token 3\): the document "
                                          r"has 20 tokens, more than the 17 a row holds"):
        load_dataset(tmp_path / "docs.bin", cfg, L, pack=True)
    data = load_dataset(tmp_path / "docs.bin", cfg, L, long_rows="cut", pack=True)
    # first fit: [5 6 2] (2 inputs) and [8 9 10 2] (3) share a row; the cut one (16) is alone
    assert data.samples[:, :-1].tolist() == [[-1] * 11 + [5, 6, 8, 9, 10], [7] * 16]
    assert data.documents.tolist() == [[0, 0, 2, 2, 2] + [5] * 11, [0] * 16]
    assert "3 documents" in data.note and "1 cut" in data.note
