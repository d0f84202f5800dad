"""Progress as jobs show it where they run: counted in tokens, a log line soon after the start
and then every interval, a last line whose count is every replica's exact work (checked
against the output files), tqdm's bar on a terminal, and nothing when asked for nothing."""

import io
import json
import re
import time

import h5py
import numpy as np
import pytest
from helpers import TINY, make_checkpoint, mpirun

from hpcpar.jobs.progress import Progress

LINE = re.compile(r"progress: (?:(?P<state>finished|ended), )?(?:(?P<detail>.*?), )?"
                  r"(?P<done>[\d,]+)/(?P<total>[\d,]+) tokens")


def _counts(stderr: str) -> list[tuple[int, int, str]]:
    """(done, total, detail) of each progress line."""
    return [(int(m["done"].replace(",", "")), int(m["total"].replace(",", "")), m["detail"] or "")
            for m in map(LINE.match, stderr.splitlines()) if m]


def _lines_until(log, enough, seconds: float = 20.0) -> list[str]:
    """The log's lines once ``enough(lines)`` holds (the display's own thread writes them:
    polled, so a loaded machine only makes it slower)."""
    deadline = time.monotonic() + seconds
    while not enough(lines := log.getvalue().splitlines()):
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)
    return lines


def test_a_log_gets_a_first_line_soon_then_one_per_interval_and_a_closing_line():
    log = io.StringIO()
    progress = Progress("generating", 1000, interval=0.05, terminal=False, out=log)
    progress.update(100, detail="1/10 prompts")
    _lines_until(log, lambda lines: len(lines) >= 3)         # several intervals: several lines
    progress.update(400, total=900)                   # rows that ended early: less work
    progress.update(300)                              # a count never goes back
    lines = _lines_until(log, lambda lines: "(44%)" in lines[-1])
    assert re.search(r"ETA \d+:\d\d", lines[-1]) and "tokens/s" in lines[-1]
    progress.update(900)
    seen = len(log.getvalue().splitlines())
    _lines_until(log, lambda lines: len(lines) >= seen + 2)  # time passes: outputs written
    progress.close()
    progress.close()                                  # once
    lines = log.getvalue().splitlines()
    counts = _counts(log.getvalue())
    assert counts[0] == (100, 1000, "1/10 prompts")
    assert counts[-1] == (900, 900, "1/10 prompts")
    assert [d for d, _, _ in counts] == sorted(d for d, _, _ in counts)
    # the closing line: the work's time, up to its last token, not the writing after it
    closing = re.fullmatch(r"progress: finished, 1/10 prompts, 900/900 tokens \(100%\) in "
                           r"\d+:\d\d, ([\d,]+) tokens/s", lines[-1])
    assert closing, lines[-1]
    assert closing[1] == f"{900 / (progress.moved - progress.start):,.0f}"
    assert progress.moved < time.perf_counter() - 0.05         # and the writing came after


def test_a_job_that_fails_gets_no_closing_line_and_interval_zero_gets_none():
    log = io.StringIO()
    progress = Progress("training", 50, interval=60, terminal=False, out=log)
    progress.update(10)
    progress.close(final=False)
    assert log.getvalue() == ""
    quiet = io.StringIO()
    Progress("scoring", 50, interval=0, terminal=False, out=quiet).update(20)
    assert quiet.getvalue() == ""


def test_a_terminal_gets_tqdms_bar_in_tokens():
    screen = io.StringIO()
    progress = Progress("scoring", 2000, terminal=True, out=screen)
    progress.update(1500, detail="step 3/4")
    progress.bar.refresh()                            # tqdm redraws at most every 0.1 s
    progress.close()
    assert "scoring" in screen.getvalue() and "1.50k/2.00k" in screen.getvalue()
    assert "step 3/4" in screen.getvalue()


def test_generated_rows_that_end_early_take_their_unused_tokens_off_the_work():
    from types import SimpleNamespace

    from hpcpar.jobs.generate.progress import GenerationProgress
    checked = SimpleNamespace(limits=np.array([8, 8, 4]), samples=SimpleNamespace(width=1),
                              prompts=SimpleNamespace(lengths=[3, 5, 2]))
    log = io.StringIO()
    progress = GenerationProgress(checked, np.array([0, 2]), interval=60, terminal=False,
                                  out=log)
    assert progress.display.total == 3 + 2 + 8 + 4            # prompt 1 was done before
    progress.heard(0, 5)                                      # replica 0: a prefill
    progress.heard(1, 4)                                      # replica 1: prefill and 2
    progress.rows_finished(np.array([2]), np.array([2]))      # EOS after 2 of 4 tokens
    assert (progress.done, progress.display.total) == (9, 15)
    progress.wave_done()
    progress.heard(0, 3)                                      # the next wave starts over
    assert progress.done == 12
    progress.close()
    assert _counts(log.getvalue()) == [(12, 15, "1/2 prompts")]
    checked.samples.width = 3                   # --n 3: a prompt's samples are rows of their own
    progress = GenerationProgress(checked, np.array([0, 1, 2]), interval=60, terminal=False,
                                  out=io.StringIO())
    progress.rows_finished(np.array([2]), np.array([4]))
    assert progress.display.detail == "1/3 sample rows"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("progress")
    make_checkpoint(work, TINY)
    rng = np.random.default_rng(3)
    with open(work / "prompts.jsonl", "w") as f:                   # each its own limit
        for i in range(14):
            f.write(json.dumps({"ids": rng.integers(3, 250, 2 + i % 5).tolist(),
                                "max_new_tokens": 3 + (5 * i) % 17}) + "\n")
    rows = rng.integers(3, 250, (10, 12))
    rows[1, :4] = -1                                               # left padding
    np.save(work / "rows.npy", rows)
    return work


def _job(work, n, args):
    proc, _ = mpirun(n, ["-m", "hpcpar", *args], work, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp", "2", "--pp", "2", "--micro-batches", "2"],
                                    ["--dp", "2", "--batching", "static", "--wave-size", "5"]],
                         ids=["dp2xpp2-continuous", "dp2-static-waves"])
def test_generation_logs_every_replicas_tokens_exactly(work, layout, monkeypatch):
    """Under mpiexec (no terminal): a line soon, and a last line whose count is the prompt
    tokens and generated tokens of the output, every replica's, with the prompts done."""
    monkeypatch.setenv("HPCPAR_PROGRESS_SECONDS", "0.2")
    n = 4 if "--pp" in layout else 2
    err = _job(work, n, ["generate", "--checkpoint", "model.h5", "--prompts", "prompts.jsonl",
                         "--max-new-tokens", "20", "--out", "g.h5", *layout])
    with h5py.File(work / "g.h5") as f:
        worked = int(f["prompt_lengths"][()].sum() + f["lengths"][()].sum())
    counts = _counts(err)
    assert counts[-1][:2] == (worked, worked) and counts[-1][2].startswith("14/14 prompts"), err
    assert [d for d, _, _ in counts] == sorted(d for d, _, _ in counts)
    if "static" not in layout:      # the paged cache of continuous batching, rank 0's replica
        assert re.fullmatch(r"14/14 prompts; replica 0: prefix cache \d+%, \d+/\d+ blocks, "
                            r"\d+ preempted", counts[-1][2]), counts[-1]
    else:
        assert counts[-1][2] == "14/14 prompts"


@pytest.mark.slow
@pytest.mark.device
def test_scoring_and_training_log_their_tokens(work, monkeypatch):
    monkeypatch.setenv("HPCPAR_PROGRESS_SECONDS", "0.2")
    err = _job(work, 4, ["score", "--checkpoint", "model.h5", "--data", "rows.npy",
                         "--out", "s.h5", "--dp", "2", "--pp", "2"])
    with h5py.File(work / "s.h5") as f:                 # each row's first token has no score
        scored = int(f["tokens_scored"][()].sum())
    assert scored == int((np.load(work / "rows.npy") >= 0).sum()) - 10
    assert _counts(err)[-1] == (scored, scored, ""), err
    assert err.strip().splitlines()[-1].startswith("progress: finished, ")
    err = _job(work, 2, ["train", "--checkpoint", "model.h5", "--data", "synthetic",
                         "--seq-len", "16", "--steps", "3", "--global-batch", "4", "--out", "run",
                         "--pp", "2"])
    counts = _counts(err)
    assert counts[-1][:2] == (3 * 4 * 16, 3 * 4 * 16), err
    assert counts[-1][2].startswith("step 3/3, loss ")
    assert [d for d, _, _ in counts] == sorted(d for d, _, _ in counts)


@pytest.mark.slow
def test_progress_seconds_zero_logs_no_progress(work, monkeypatch):
    monkeypatch.setenv("HPCPAR_PROGRESS_SECONDS", "0")
    err = _job(work, 1, ["score", "--checkpoint", "model.h5", "--data", "rows.npy",
                         "--out", "s0.h5"])
    assert "progress:" not in err
