"""``hpcpar show``: a generation output (HDF5 and JSONL), a scoring output, a training run
and a checkpoint, as text and as JSON, each checked against the file read directly; pages;
a damaged or hand-edited output read as far as it can be, with a note on what was not; and
what it cannot read at all (a named pipe or a device before it is opened), one line, status 2."""

import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager

import h5py
import numpy as np
import pytest
from helpers import (TINY, hpcpar_here, make_checkpoint, mpirun, realistic_tensors,
                     write_hf_checkpoint)

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


def test_a_stopped_runs_output_says_how_far_it_got_and_how_to_finish(outputs):
    """A generation stopped early leaves its finished rows in a hidden .NAME.partial and no
    NAME: show of either says so, how many rows are done, and to run again with --resume
    auto (it said "no such file", or refused the partial as no hpcpar output)."""
    shutil.copy(outputs / "g.h5", outputs / ".stopped.h5.partial")
    with h5py.File(outputs / ".stopped.h5.partial", "r+") as f:
        f["done"] = np.arange(len(f["tokens"])) < 3
        rows = len(f["tokens"])
    for name in ("stopped.h5", ".stopped.h5.partial"):
        proc = _show(name, cwd=outputs)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert (f"stopped.h5: not written yet: a stopped run left .stopped.h5.partial (3 of "
                f"{rows} rows finished); run the same command again with --resume auto"
                in proc.stderr), proc.stderr


@pytest.fixture(scope="module")
def batch(outputs):
    """A Batch API output of three requests: one answered, one with two choices, one refused
    (its url); made in this process, on a copy of the tiny model with a word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hpcpar.checkpoint import convert
    folder = outputs / "batch"
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY["vocab_size"] - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    write_hf_checkpoint(folder / "hf", TINY, extra=realistic_tensors(TINY, 0))
    tok.save(str(folder / "hf" / "tokenizer.json"))
    convert(folder / "hf", folder / "words.h5")
    url = "/v1/completions"
    requests = [{"custom_id": "one", "url": url, "body": {"prompt": "w5 w6 w7"}},
                {"custom_id": "two", "url": url, "body": {"prompt": "w8", "n": 2,
                                                          "temperature": 1.0, "seed": 1}},
                {"custom_id": "refused", "url": "/v1/embeddings", "body": {"input": "w8"}}]
    (folder / "requests.jsonl").write_text("".join(
        json.dumps(dict(r, method="POST")) + "\n" for r in requests))
    proc = hpcpar_here(["generate", "--checkpoint", "words.h5", "--prompts", "requests.jsonl",
                        "--max-new-tokens", "3", "--out", "b.jsonl"], folder)
    assert proc.returncode == 5, proc.stderr                  # one request refused
    shutil.copy(folder / "b.jsonl", outputs / "b.jsonl")
    return outputs / "b.jsonl"


def _delete(*names):
    """Damage: an HDF5 output without these datasets or attributes."""
    def damage(path):
        with h5py.File(path, "r+") as f:
            for name in names:
                del (f if name in f else f.attrs)[name]
    return damage


def _replace(name, values):
    """Damage: an HDF5 output's dataset ``name`` holding ``values`` instead."""
    def damage(path):
        with h5py.File(path, "r+") as f:
            del f[name]
            f[name] = values
    return damage


def _line(n, change):
    """Damage: line ``n`` (from 1) of a JSON-lines file changed: ``change(record)`` edits the
    record in place, or a string replaces the line's text."""
    def damage(path):
        lines = path.read_text().splitlines()
        if isinstance(change, str):
            lines[n - 1] = change
        else:
            record = json.loads(lines[n - 1])
            change(record)
            lines[n - 1] = json.dumps(record)
        path.write_text("".join(line + "\n" for line in lines))
    return damage


def _set(**fields):
    return lambda record: record.update(fields)


def _in_run(name, damage):
    """Damage: the file ``name`` of a training run's folder damaged by ``damage``."""
    return lambda folder: damage(folder / name)


def _write(data: bytes):
    return lambda path: path.write_bytes(data)


def _folder(path):
    path.unlink()
    path.mkdir()


def _fifo(path):
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _device(target):
    """Damage: a link to a device instead of the file (/dev/zero: read forever)."""
    def damage(path):
        path.unlink(missing_ok=True)
        path.symlink_to(target)
    return damage


def _no_body(record):
    del record["response"]["body"]


def _no_usage(record):
    del record["response"]["body"]["usage"]


@contextmanager
def _answered(folder):
    """While the block runs, any named pipe under ``folder`` that something opens to read gets
    a line that is no output, so that code which opens one fails the test instead of blocking
    it forever."""
    fifos = [p for p in folder.rglob("*") if p.is_fifo()]
    done = threading.Event()

    def answer():
        while not done.wait(0.01):
            for fifo in fifos:
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:                       # no reader waits on it
                    continue
                os.write(fd, b"not an output\n")
                os.close(fd)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _damaged(source, damage, folder):
    """A copy of the real output ``source`` in ``folder``, damaged by ``damage(copy)``."""
    copy = folder / source.name
    (shutil.copytree if source.is_dir() else shutil.copy)(source, copy)
    damage(copy)
    return copy


# (output, damage, what its note says (None: nothing lost), rows or steps still shown)
DAMAGED = {
    "h5 without lengths": ("g.h5", _delete("lengths"), "lengths (missing)", 8),
    "h5 without finish_reason": ("g.h5", _delete("finish_reason"),
                                 "finish_reason (missing)", 8),
    "h5 without tokens": ("g.h5", _delete("tokens"), "tokens (missing)", 8),
    "h5 lengths as text": ("g.h5", _replace("lengths", np.array([b"5"] * 8)),
                           "lengths (strings, not integers)", 8),
    "scores without perplexity": ("s.h5", _delete("perplexity"),
                                  "perplexity (missing): computed from the rows", 24),
    "scores without nll": ("s.h5", _delete("nll"), "nll (missing)", 24),
    "jsonl null index": ("g.jsonl", _line(2, _set(index=None)), "a null or mistyped index",
                         7),
    "jsonl null finish_reason": ("g.jsonl", _line(3, _set(finish_reason=None)),
                                 "a null or mistyped finish_reason", 7),
    "jsonl count as text": ("g.jsonl", _line(2, _set(completion_tokens="5")),
                            "a null or mistyped completion_tokens", 7),
    "jsonl text a number": ("g.jsonl", _line(2, _set(text=5)), "a null or mistyped text", 7),
    "jsonl null token_ids": ("g.jsonl", _line(8, _set(token_ids=None)),
                             "a null or mistyped token_ids", 7),
    "jsonl torn line": ("g.jsonl", _line(4, '{"index": 3, "te'), "not JSON", 7),
    "batch without body": ("b.jsonl", _line(1, _no_body), "a response without a body", 3),
    "batch without usage": ("b.jsonl", _line(2, _no_usage), "a body without its usage", 2),
    "batch null custom_id": ("b.jsonl", _line(1, _set(custom_id=None)),
                             "a custom_id that is not a string", 3),
    "batch error as text": ("b.jsonl", _line(3, _set(error="refused")), None, 4),
    "run report not JSON": ("run", _in_run("report.json", _write(b'{"steps": ')),
                            "report.json: not JSON", 3),
    "run report a pipe": ("run", _in_run("report.json", _fifo),
                          "report.json: a named pipe (FIFO), not a regular file", 3),
    "run latest not text": ("run", _in_run("latest", _write(b"\xff\xfe")),
                            "latest: not a checkpoint's file name", 3),
    "run latest a folder": ("run", _in_run("latest", _folder),
                            "latest: a folder, not a regular file", 3),
    "run latest a device": ("run", _in_run("latest", _device("/dev/null")),
                            "latest: a link to /dev/null, a character device", 3),
    "run metrics a list": ("run", _in_run("metrics.jsonl", _line(2, "[1, 2]")),
                           "1 of 3 lines not read (line 2): not a step's metrics", 2),
    "run metrics loss as text": ("run", _in_run("metrics.jsonl", _line(3, _set(loss="x"))),
                                 "a null or mistyped loss", 2),
    "run metrics a pipe": ("run", _in_run("metrics.jsonl", _fifo),
                           "metrics.jsonl: a named pipe (FIFO), not a regular file", 0),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_output_shows_what_it_can_with_a_note_on_what_it_cannot(
        outputs, batch, tmp_path, case):
    name, damage, note, shown = DAMAGED[case]
    path = _damaged(outputs / name, damage, tmp_path)
    pages = [] if path.is_dir() else ["--per-page", "100"]
    with _answered(tmp_path):
        proc = hpcpar_here(["show", path, "--json", *pages], tmp_path)
        text = hpcpar_here(["show", path], tmp_path)
    assert proc.returncode == 0 and text.returncode == 0, proc.stderr + text.stderr
    s = json.loads(proc.stdout)
    assert len(s["rows"] if "rows" in s else s["last_steps"]) == shown
    if note is None:
        assert s["notes"] == []
        return
    assert len(s["notes"]) == 1 and note in s["notes"][0], s["notes"]
    assert f"note: {s['notes'][0]}" in text.stdout.splitlines(), text.stdout


# (output, damage, the one line's words): nothing left to show, or a file show must not open
UNREADABLE = {
    "a named pipe": ("g.jsonl", _fifo, "g.jsonl: a named pipe (FIFO), not a regular file or "
                                       "folder; show reads"),
    "a link to /dev/zero": ("g.h5", _device("/dev/zero"), "g.h5: a link to /dev/zero, a character "
                                               "device, not a regular file or folder"),
    "h5 without any row": ("g.h5", _delete("lengths", "finish_reason", "tokens"),
                           "g.h5: a generation output without its lengths, finish_reason, "
                           "tokens or text; nothing to show"),
    "jsonl of torn lines": ("g.jsonl", _write(b'{"index": 0, "te\n{"ind\n'),
                            "g.jsonl: not an hpcpar output"),
    "jsonl without a line read": ("g.jsonl", _write(b'{"index": null, "text": null, "token_ids"'
                                                    b': [], "finish_reason": "length", '
                                                    b'"prompt_tokens": 1, "completion_tokens"'
                                                    b': 0}\n'),
                                  "g.jsonl: none of its 1 lines could be read (a null or "
                                  "mistyped index)"),
    "scores without rows": ("s.h5", _delete("nll", "tokens_scored", "perplexity"),
                            "s.h5: a scoring output without its nll, tokens_scored or "
                            "perplexity; nothing to show"),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_what_show_cannot_read_at_all_is_one_line(outputs, tmp_path, case):
    name, damage, words = UNREADABLE[case]
    path = _damaged(outputs / name, damage, tmp_path)
    with _answered(tmp_path):
        proc = hpcpar_here(["show", path.name], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _batch_line(custom_id: str, choices: list[dict], completion_tokens: int) -> str:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
            "choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens":
                                          completion_tokens,
                                          "total_tokens": 3 + completion_tokens}}
    return json.dumps({"id": f"batch_req_{custom_id}", "custom_id": custom_id,
                       "response": {"status_code": 200, "request_id": "r", "body": body},
                       "error": None}) + "\n"


def test_a_batch_requests_samples_show_their_own_counts_and_no_control_characters(tmp_path):
    """usage counts a request's n choices together: each choice shows its own count where
    its log-probs list its tokens (else none), the total is usage's; a model's ESC reaches
    the terminal as an escape, not as a cursor move."""
    from hpcpar.jobs.show import format_summary, summary
    choice = {"index": 0, "text": "a\x1b[2Jb", "finish_reason": "length", "logprobs": None}
    listed = [dict(choice, index=i, logprobs={"tokens": ["x"] * k, "token_logprobs": [0.0] * k,
                                              "top_logprobs": [{}] * k, "text_offset": [0] * k})
              for i, k in enumerate((3, 4))]
    (tmp_path / "out.jsonl").write_text(
        _batch_line("listed", listed, 7) + _batch_line("bare", [choice, dict(choice, index=1)], 8)
        + _batch_line("one", [choice], 5))
    s = summary(tmp_path / "out.jsonl")
    assert [(r["index"], r.get("sample"), r["completion_tokens"]) for r in s["rows"]] == [
        ("listed", 0, 3), ("listed", 1, 4), ("bare", 0, None), ("bare", 1, None),
        ("one", None, 5)]
    assert s["completion_tokens"] == 20
    shown = format_summary(s)
    assert "\x1b" not in shown and "a\\x1b[2Jb" in shown
