"""``hpcpar show``: a generation output (HDF5 and JSONL), a scoring output, a training run
and a checkpoint, as text and as JSON, each checked against the file read directly; pages;
and what it cannot read, one line, status 2."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import TINY, make_checkpoint, mpirun

# processes of their own: the whole suite's tier, not tests/run --quick
pytestmark = pytest.mark.slow


def _show(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcpar", "show", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """A checkpoint, and a generation (HDF5 and JSONL), a scoring and a training run of it."""
    work = tmp_path_factory.mktemp("show")
    make_checkpoint(work, TINY)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, TINY["vocab_size"], (24, 9))
    rows[2, :3] = -1
    np.save(work / "rows.npy", rows)
    base = ["-m", "hpcpar"]
    for args in (["generate", "--checkpoint", "model.h5", "--prompts", "random",
                  "--max-new-tokens", "5", "--out", "g.h5"],
                 ["generate", "--checkpoint", "model.h5", "--prompts", "random",
                  "--max-new-tokens", "5", "--out", "g.jsonl"],
                 ["score", "--checkpoint", "model.h5", "--data", "rows.npy", "--out", "s.h5"],
                 ["train", "--checkpoint", "model.h5", "--data", "rows.npy", "--steps", "3",
                  "--global-batch", "8", "--out", "run"]):
        proc, _ = mpirun(1, base + args, work, timeout=300)
        assert proc.returncode == 0, proc.stderr
    return work


def test_a_generation_output_shows_every_prompt_as_the_file_holds_it(outputs):
    proc = _show("g.h5", "--json", "--per-page", "100", cwd=outputs)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    with h5py.File(outputs / "g.h5") as f:
        lengths, tokens = f["lengths"][()], f["tokens"][()]
        reasons = [r.decode() for r in f["finish_reason"][()]]
        prompt_lengths = f["prompt_lengths"][()]
        decode = float(f.attrs["report_decode_tokens_per_s"])
    assert shown["prompts"] == len(lengths) == len(shown["rows"])
    assert shown["completion_tokens"] == int(lengths.sum())
    assert shown["report"]["decode_tokens_per_s"] == pytest.approx(decode)
    for i, row in enumerate(shown["rows"]):
        assert row["token_ids"] == tokens[i, :lengths[i]].tolist()
        assert (row["finish_reason"], row["prompt_tokens"]) == (reasons[i], prompt_lengths[i])
    jsonl = json.loads(_show("g.jsonl", "--json", "--per-page", "100", cwd=outputs).stdout)
    lines = [json.loads(line) for line in open(outputs / "g.jsonl")]
    assert jsonl["rows"] == sorted(lines, key=lambda r: r["index"])
    text = _show("g.h5", "--per-page", "3", cwd=outputs).stdout.splitlines()
    assert text[0].startswith(f"g.h5: generation, {len(lengths)} prompts")
    assert len([line for line in text if line.lstrip()[:1].isdigit()]) == 3
    assert text[-1] == f"page 1 of {-(-len(lengths) // 3)}; --page 2 for the next"
    second = json.loads(_show("g.h5", "--json", "--per-page", "3", "--page", "2",
                              cwd=outputs).stdout)
    assert [r["index"] for r in second["rows"]] == [3, 4, 5]


def test_scores_a_training_run_and_a_checkpoint_show_what_their_files_hold(outputs):
    scores = json.loads(_show("s.h5", "--json", "--per-page", "100", cwd=outputs).stdout)
    with h5py.File(outputs / "s.h5") as f:
        nll, scored, perplexity = f["nll"][()], f["tokens_scored"][()], f.attrs["perplexity"]
    assert scores["perplexity"] == pytest.approx(perplexity)
    assert [r["nll"] for r in scores["rows"]] == pytest.approx(nll.tolist())
    assert [r["tokens_scored"] for r in scores["rows"]] == scored.tolist()
    run = json.loads(_show("run", "--json", cwd=outputs).stdout)
    metrics = [json.loads(line) for line in open(outputs / "run" / "metrics.jsonl")]
    assert run["last_steps"] == metrics and run["steps_logged"] == 3
    assert run["latest_checkpoint"].endswith("step-3.h5")
    text = _show("run", cwd=outputs).stdout
    assert f"{metrics[-1]['loss']:.4f}" in text
    ckpt = json.loads(_show("run/step-3.h5", "--json", cwd=outputs).stdout)
    assert ckpt["model_type"] == "llama" and ckpt["layers"] == TINY["num_hidden_layers"]
    assert ckpt["training"]["step"] == 3 and ckpt["training"]["optimizer"] == "adamw"
    with h5py.File(outputs / "model.h5") as f:
        count = sum(d.size for name, d in f.items() if isinstance(d, h5py.Dataset))
    assert json.loads(_show("model.h5", "--json", cwd=outputs).stdout)["parameters"] == count


@pytest.mark.parametrize("args, words", [
    (["rows.npy"], "rows.npy: not an hpcpar output; show reads"),
    (["missing.h5"], "missing.h5: no such file or folder"),
    (["g.h5", "--page", "99"], "--page 99: there are 1 page(s) of 20 rows"),
    (["g.h5", "--per-page", "0"], "both count from 1"),
])
def test_what_show_cannot_read_is_one_line(outputs, args, words):
    proc = _show(*args, cwd=outputs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
