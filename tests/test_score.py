"""The scoring job against transformers: token log-probabilities equal to
``log_softmax(LlamaForCausalLM(ids).logits)`` at each next token (float32, <= 1e-4), under one
rank and under every dp x pp x tp layout of the world's size (mpiexec -n 2, 4, 8); the
output's NaNs, sums and perplexity; logits formed a block of positions at a time; bad input
as one clear error before any work."""

import json
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from helpers import (HF_CONFIGS, PROMPTS, TINY, WORLD_SIZES, build_hf_model, make_checkpoint,
                     mpirun)
from hpcpar.jobs.job import load_job
from hpcpar.jobs.score import run_scoring
from hpcpar.jobs.score import program as score_program

LAYOUTS = {   # (dp, pp, tp, micro_batches), keyed by world size
    2: [(1, 1, 2, 1), (1, 2, 1, 2), (2, 1, 1, 1)],
    4: [(1, 2, 2, 3), (2, 1, 2, 2), (2, 2, 1, 2)],
    8: [(2, 2, 2, 2), (1, 2, 4, 1), (4, 2, 1, 1)],
}


def _padded(prompts) -> np.ndarray:
    """The rows left-padded with -1 to the longest."""
    width = max(len(p) for p in prompts)
    out = np.full((len(prompts), width), -1, dtype=np.int64)
    for r, p in enumerate(prompts):
        out[r, width - len(p):] = p
    return out


def _score(comm, checkpoint, data, out, layout=(1, 1, 1, 1), cp=1):
    dp, pp, tp, mbs = layout
    sets = [f"model.checkpoint='{checkpoint}'", f"score.data='{data}'",
            f"output.path='{out}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.tp={tp}", f"parallel.micro_batches={mbs}", f"parallel.cp={cp}"]
    return run_scoring(comm, load_job(None, sets))


def transformers_logprobs(model, prompts) -> list[np.ndarray]:
    """For each prompt, log p(prompt[t] | prompt[:t]) for t >= 1, from transformers' logits."""
    import torch
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor(prompt[None])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)[:-1]
            out.append(logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy())
    return out


def check_against(result, expected, offsets):
    """The scoring ``result`` holds the ``expected`` log-probabilities (transformers_logprobs)
    of rows left-padded by ``offsets``, and NaN elsewhere."""
    for r, want in enumerate(expected):
        row = result.token_logprobs[r]
        o = offsets[r]
        np.testing.assert_allclose(row[o + 1:o + 1 + len(want)], want, atol=1e-4, rtol=0,
                                   err_msg=f"row {r}")
        assert np.isnan(row[:o + 1]).all() and np.isnan(row[o + 1 + len(want):]).all()


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_model(request, tmp_path_factory):
    return build_hf_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.device
def test_left_padded_rows_score_as_transformers_and_the_file_holds_the_sums(hf_model, tmp_path):
    model, checkpoint = hf_model
    data = tmp_path / "rows.npy"
    padded = _padded(PROMPTS)
    np.save(data, padded)
    result = _score(MPI.COMM_SELF, checkpoint, data, tmp_path / "scores.h5")
    offsets = [padded.shape[1] - len(p) for p in PROMPTS]
    check_against(result, transformers_logprobs(model, PROMPTS), offsets)
    with h5py.File(tmp_path / "scores.h5") as f:
        np.testing.assert_array_equal(f["token_logprobs"][:], result.token_logprobs)
        nll, scored = f["nll"][:], f["tokens_scored"][:]
        assert scored.tolist() == [len(p) - 1 for p in PROMPTS]
        np.testing.assert_allclose(nll, -np.nansum(f["token_logprobs"][:].astype(np.float64),
                                                   axis=1))
        assert f.attrs["perplexity"] == pytest.approx(np.exp(nll.sum() / scored.sum()))
        assert f.attrs["tp"] == 1 and "tokens_per_s" in f.attrs


@pytest.mark.device
def test_jsonl_rows_start_at_column_zero_and_blocks_of_positions_change_nothing(
        hf_model, tmp_path, monkeypatch):
    model, checkpoint = hf_model
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"ids": p.tolist()}) + "\n" for p in PROMPTS))
    whole = _score(MPI.COMM_SELF, checkpoint, data, tmp_path / "a.h5")
    check_against(whole, transformers_logprobs(model, PROMPTS), [0] * len(PROMPTS))
    monkeypatch.setattr(score_program, "LOGITS_BLOCK_BYTES", 1)   # one position per block
    blocks = _score(MPI.COMM_SELF, checkpoint, data, tmp_path / "b.h5")
    np.testing.assert_allclose(blocks.token_logprobs, whole.token_logprobs, atol=1e-6, rtol=0)


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the layouts of each world size
@pytest.mark.parametrize("family", ["gqa-llama3", "qwen2", "qwen3", "gemma", "qwen3_moe"])
def test_every_layout_scores_as_transformers(tmp_path_factory, family):
    """Every layout against transformers' own class, for Llama, Qwen2 (q/k/v biases split
    with their heads), Qwen3 (q/k norms over split and replicated KV heads), Gemma (one KV
    head) and Qwen3-MoE (experts split over tp like the dense MLP, a dense layer between)."""
    comm = MPI.COMM_WORLD
    expected, folder = None, None
    if comm.Get_rank() == 0:
        folder = tmp_path_factory.mktemp("score")
        model, _ = build_hf_model(family, folder)
        expected = transformers_logprobs(model, PROMPTS)
        np.save(folder / "rows.npy", _padded(PROMPTS))
    folder = comm.bcast(str(folder) if folder else None, root=0)
    offsets = [max(len(p) for p in PROMPTS) - len(p) for p in PROMPTS]
    assert LAYOUTS[comm.Get_size()], f"no layout to compare at {comm.Get_size()} ranks"
    for layout in LAYOUTS[comm.Get_size()]:
        result = _score(comm, f"{folder}/model.h5", f"{folder}/rows.npy",
                        f"{folder}/scores-{'-'.join(map(str, layout))}.h5", layout)
        if comm.Get_rank() == 0:
            check_against(result, expected, offsets)
        else:
            assert result is None


# (dp, pp, cp, tp, micro_batches), keyed by world size
CP_LAYOUTS = {
    2: [(1, 1, 2, 1, 1)],
    4: [(1, 1, 4, 1, 2), (1, 2, 2, 1, 2), (2, 1, 2, 1, 1)],
    8: [(1, 1, 8, 1, 1), (2, 2, 2, 1, 2), (1, 2, 2, 2, 1)],
}
# 150 positions (more than one 128-position tile, divisible by no cp size), a left-padded
# row of 131, and rows shorter than the cp group (a micro-batch of them alone is padded)
LONG_PROMPTS = [np.random.default_rng(7).integers(0, 250, n) for n in (150, 131, 3, 2)]


@pytest.mark.device
@pytest.mark.mpi(ranks=WORLD_SIZES)        # the cp layouts of each world size
@pytest.mark.parametrize("family", ["gqa-llama3", "qwen3"])
def test_context_parallel_layouts_score_long_rows_as_transformers(tmp_path_factory, family):
    comm = MPI.COMM_WORLD
    expected, folder = None, None
    if comm.Get_rank() == 0:
        folder = tmp_path_factory.mktemp("score-cp")
        model, _ = build_hf_model(family, folder, max_position_embeddings=256)
        expected = transformers_logprobs(model, LONG_PROMPTS)
        np.save(folder / "rows.npy", _padded(LONG_PROMPTS))
    folder = comm.bcast(str(folder) if folder else None, root=0)
    offsets = [max(len(p) for p in LONG_PROMPTS) - len(p) for p in LONG_PROMPTS]
    for dp, pp, cp, tp, mbs in CP_LAYOUTS[comm.Get_size()]:
        result = _score(comm, f"{folder}/model.h5", f"{folder}/rows.npy",
                        f"{folder}/scores-{dp}{pp}{cp}{tp}{mbs}.h5", (dp, pp, tp, mbs), cp=cp)
        if comm.Get_rank() == 0:
            check_against(result, expected, offsets)
            with h5py.File(f"{folder}/scores-{dp}{pp}{cp}{tp}{mbs}.h5") as f:
                assert f.attrs["cp"] == cp


@pytest.mark.slow
@pytest.mark.parametrize("rows,message", [
    ([[5, 6, -1]], "pad on the left only"),
    ([[-1, -1, -1], [4, 5, 6]], "row 0 is all padding"),
    ([[-1, 4, 999]], "row 0 holds token id 999, outside the model's vocabulary"),
])
def test_bad_rows_are_one_error_from_one_rank_and_no_output(tmp_path, rows, message):
    make_checkpoint(tmp_path, TINY)
    np.save(tmp_path / "rows.npy", np.array(rows))
    proc, _ = mpirun(2, ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data",
                         "rows.npy", "--out", "scores.h5"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "scores.h5").exists()
    assert not list(tmp_path.glob(".scores.h5*"))


@pytest.mark.slow
@pytest.mark.parametrize("signum, which, nodes", [(15, 1, 1), (2, 0, 1), (15, 1, 2)])
def test_a_stop_signal_to_one_rank_ends_the_scoring_with_one_line_and_no_lock(tmp_path, signum,
                                                                              which, nodes):
    """SIGTERM or SIGINT to any one rank of a scoring job: every rank stops at its next
    micro-batch or wait (the signal reaches its node's ranks through the watchdog's shared
    row, and the other nodes' through a message: they waited for the timeout before), one
    line says what stopped, and neither the output nor its lock is left (the lock used to
    stay, and SIGTERM to a rank killed it). The status is 3 (it was 9 in 1 run in 12: a
    heartbeat left unmatched made rank 0's MPI_Finalize fail, and mpiexec then killed the
    rank still finishing)."""
    import signal
    import subprocess
    import sys
    import time
    from helpers import MPIEXEC, REPO
    make_checkpoint(tmp_path, TINY)
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, TINY["vocab_size"],
                                                                     (3000, 48)))
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_PROGRESS_SECONDS="0.05",
               HPCPAR_FAKE_NODES=str(nodes),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "hpcpar", "score",
                             "--checkpoint", "model.h5", "--data", "data.npy", "--out",
                             "out.h5", "--dp", "1", "--pp", "2", "--timeout", "30"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".out.h5.lock"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not lock.exists():
        time.sleep(0.01)
    time.sleep(1.0)                                        # into the scoring
    os.kill(_rank_process(proc.pid, which), signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    lines = [line for line in err.splitlines() if line.startswith("hpcpar:")]
    name = signal.Signals(signum).name
    assert lines == [f"hpcpar: stopped on request ({name} to rank {which}) while scoring: "
                     "nothing was written; run it again to score"], err
    assert "Traceback" not in err
    assert not lock.exists() and not (tmp_path / "out.h5").exists()


def _rank_process(launcher: int, rank: int) -> int:
    """The process of world rank ``rank`` (under its keeper: the one that holds the keeper's
    pipe in its environment)."""
    for pid in _descendants(launcher):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ and any(
                item.startswith(b"HPCPAR_SUPERVISED_FD=") for item in environ):
            return pid
    raise AssertionError(f"no process of rank {rank}")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child in os.popen(f"pgrep -P {parent}").read().split():
            out.append(int(child))
            todo.append(int(child))
    return out
