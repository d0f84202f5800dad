"""Log-probabilities of generated and prompt tokens (``--logprobs K``, ``--prompt-logprobs K``):
equal to ``log_softmax`` of transformers' logits on the same model and sequence, with the K
most likely alternatives, before temperature and penalties; the same under tp x pp and both
batchings; per line in JSON lines, in HDF5 datasets; refused where they cannot be given."""

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import (PROMPTS, build_hf_model, generate_here, hpcpar_here, mpirun,  # noqa: E402
                     refused)
from hpcpar.jobs.generate import run_generation  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402

K = 5
TOLERANCE = 2e-5            # float32 logits, summed in another order


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_hf_model("gqa-llama3", tmp_path_factory.mktemp("logprobs"))




def _reference(model, prompt, new_tokens):
    """transformers' log-softmax (positions, vocab) of the prompt followed by its new tokens."""
    ids = torch.tensor([list(prompt) + list(new_tokens)])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0].double(), -1).numpy()


def _check_token_logprobs(model, result, k=K):
    for b, prompt in enumerate(PROMPTS):
        n = int(result.lengths[b])
        new = result.tokens[b, :n]
        ref = _reference(model, prompt, new)[len(prompt) - 1:len(prompt) - 1 + n]   # (n, V)
        chosen = ref[np.arange(n), new]
        np.testing.assert_allclose(result.logprobs.values[b, :n], chosen, atol=TOLERANCE)
        best = np.argsort(-ref, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(result.logprobs.top_ids[b, :n, :k], best)
        np.testing.assert_allclose(result.logprobs.top[b, :n, :k],
                                   np.take_along_axis(ref, best, 1), atol=TOLERANCE)
        assert np.isnan(result.logprobs.values[b, n:]).all()


@pytest.mark.device
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_greedy_token_and_prompt_logprobs_are_transformers_log_softmax(llama, batching):
    model, path = llama
    ours = generate_here(path, 8, f"generate.logprobs={K}", "generate.prompt_logprobs=3",
                 f"generate.batching='{batching}'")
    _check_token_logprobs(model, ours)
    for b, prompt in enumerate(PROMPTS):
        ref = _reference(model, prompt, [])
        values = ours.prompt_logprobs.values[b]
        assert np.isnan(values[0]) and np.isnan(values[len(prompt):]).all()
        t = np.arange(1, len(prompt))
        np.testing.assert_allclose(values[t], ref[t - 1, prompt[t]], atol=TOLERANCE)
        best = np.argsort(-ref[t - 1], axis=1, kind="stable")[:, :3]
        np.testing.assert_array_equal(ours.prompt_logprobs.top_ids[b, t], best)
        np.testing.assert_allclose(ours.prompt_logprobs.top[b, t],
                                   np.take_along_axis(ref[t - 1], best, 1), atol=TOLERANCE)
    plain = generate_here(path, 8, f"generate.batching='{batching}'")
    np.testing.assert_array_equal(ours.tokens, plain.tokens)    # asking changes no token
    assert plain.logprobs is None and plain.prompt_logprobs is None


@pytest.mark.device
def test_sampled_logprobs_are_the_models_before_temperature_and_penalties(llama):
    """The tokens are drawn at temperature 1.7 under a repetition penalty; their log-probs
    are still the model's own distribution's (vLLM's default)."""
    model, path = llama
    ours = generate_here(path, 8, f"generate.logprobs={K}", "generate.temperature=1.7",
                 "generate.seed=4", "generate.repetition_penalty=1.4", "generate.top_k=20")
    _check_token_logprobs(model, ours)
    assert (ours.tokens != generate_here(path, 8).tokens).any()       # sampling changed the tokens


@pytest.mark.device
def test_logprobs_zero_gives_the_tokens_own_and_no_alternatives(llama):
    model, path = llama
    ours = generate_here(path, 4, "generate.logprobs=0")
    assert ours.logprobs.top.shape[-1] == 0
    _check_token_logprobs(model, ours, k=0)


def test_logprobs_zero_with_two_samples_in_hdf5_json_lines_and_a_resume(llama, tmp_path,
                                                                       monkeypatch):
    """``--n 2 --logprobs 0`` (each sampled token's log p, no alternatives: top arrays of
    width 0) on 8 prompts, their 16 rows finishing together: the HDF5 file (with its sample
    axis) and the JSON lines are written (h5py refused a selection of 16 rows of an empty
    dataset, and ``reshape`` has no -1 to infer in an empty array), each token's log p is
    transformers' and the same run's with ``--logprobs 1``; a run stopped once the short
    prompts finished resumes to the uninterrupted run's lines."""
    model, path = llama
    prompts = [p.tolist() for p in PROMPTS] + [[3, 4, 5], [9, 8, 7, 6], [100, 50]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    short = [{"ids": p} | ({"max_new_tokens": 2} if b < 5 else {})
             for b, p in enumerate(prompts)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(line) + "\n" for line in short))

    def args(out, k, source="p.jsonl", *more):
        return ["generate", "--checkpoint", str(path), "--prompts", source, "--out", out,
                "--max-new-tokens", "4", "--ignore-eos", "--n", "2", "--temperature", "1",
                "--seed", "3", "--logprobs", str(k), *more]

    def run(*given):
        return hpcpar_here(args(*given), tmp_path)

    for out, k in (("k0.h5", 0), ("k1.h5", 1), ("k0.jsonl", 0)):
        proc = run(out, k)
        assert proc.returncode == 0, proc.stderr[-3000:]
    with h5py.File(tmp_path / "k0.h5") as f, h5py.File(tmp_path / "k1.h5") as g:
        tokens, lengths, values = f["tokens"][()], f["lengths"][()], f["logprobs"][()]
        assert tokens.shape == (8, 2, 4) and (lengths == 4).all()
        assert f["top_logprobs"].shape == f["top_token_ids"].shape == (8, 2, 4, 0)
        np.testing.assert_array_equal(g["tokens"][()], tokens)    # asking changes no token
        np.testing.assert_allclose(values, g["logprobs"][()], atol=1e-6)
    assert (tokens[:, 0] != tokens[:, 1]).any()                  # two samples, not one twice
    for b, prompt in enumerate(prompts):
        for s in range(2):
            ref = _reference(model, prompt, tokens[b, s])[len(prompt) - 1:][:4]
            np.testing.assert_allclose(values[b, s], ref[np.arange(4), tokens[b, s]],
                                       atol=TOLERANCE)
    records = [json.loads(line) for line in open(tmp_path / "k0.jsonl")]
    assert [(r["index"], r["sample"]) for r in records] == [(b, s) for b in range(8)
                                                            for s in range(2)]
    for r in records:
        b, s = r["index"], r["sample"]
        assert r["token_ids"] == tokens[b, s].tolist()
        assert [e["top_logprobs"] for e in r["logprobs"]] == [[]] * 4
        np.testing.assert_allclose([e["logprob"] for e in r["logprobs"]], values[b, s],
                                   rtol=1e-6)
    # failed at decode step 3 (a process of its own): the short prompts' 10 rows are kept
    assert run("straight.jsonl", 0, "s.jsonl").returncode == 0
    monkeypatch.setenv("HPCPAR_SAVE_SECONDS", "0")
    monkeypatch.setenv("HPCPAR_FAULT", "rank=0,phase=decode,step=3,kind=raise")
    proc = mpirun(1, ["-m", "hpcpar", *args("stopped.jsonl", 0, "s.jsonl")], tmp_path)[0]
    assert proc.returncode == 1 and "injected fault" in proc.stderr, proc.stderr[-3000:]
    monkeypatch.delenv("HPCPAR_FAULT")
    with h5py.File(tmp_path / ".stopped.jsonl.partial") as f:
        np.testing.assert_array_equal(np.flatnonzero(f["done"][()]), range(10))
    proc = run("stopped.jsonl", 0, "s.jsonl", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, straight = ([json.loads(line) for line in open(tmp_path / name)]
                         for name in ("stopped.jsonl", "straight.jsonl"))
    assert len(resumed) == len(straight) == 16
    for a, b in zip(resumed, straight):         # the rest ran in smaller batches: float32 sums
        logprobs = [[e.pop("logprob") for e in r["logprobs"]] for r in (a, b)]
        assert a == b
        np.testing.assert_allclose(*logprobs, atol=TOLERANCE)
    assert not (tmp_path / ".stopped.jsonl.partial").exists()


@pytest.mark.slow
@pytest.mark.device
def test_logprobs_are_the_same_under_tp_and_pp_in_hdf5_and_json_lines(llama, tmp_path):
    """tp 2 x pp 2 (a vocab-parallel head: the normalizer and the top K reduced over tp),
    per line: K 4 on one, the job's 2 on others, none on one; the HDF5 datasets and the JSON
    lines hold transformers' values."""
    model, path = llama
    lines = [{"ids": p.tolist()} for p in PROMPTS]
    lines[1]["logprobs"] = 4
    lines[2]["logprobs"] = None
    lines[3]["prompt_logprobs"] = 1
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts", "p.jsonl",
            "--max-new-tokens", "6", "--ignore-eos", "--logprobs", "2", "--tp", "2",
            "--pp", "2"]
    for out in ("o.h5", "o.jsonl"):
        proc = mpirun(4, [*args, "--out", out], tmp_path, timeout=120)[0]
        assert proc.returncode == 0, proc.stderr[-3000:]
    with h5py.File(tmp_path / "o.h5") as f:
        values, top_ids = f["logprobs"][()], f["top_token_ids"][()]
        tokens, lengths = f["tokens"][()], f["lengths"][()]
        prompt_values = f["prompt_logprobs"][()]
        assert f["top_logprobs"].shape == top_ids.shape == (len(PROMPTS), 6, 4)
    records = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    for b, prompt in enumerate(PROMPTS):
        n = int(lengths[b])
        assert records[b]["token_ids"] == tokens[b, :n].tolist()
        ref = _reference(model, prompt, tokens[b, :n])[len(prompt) - 1:][:n]
        k = {1: 4, 2: -1}.get(b, 2)
        if k < 0:
            assert np.isnan(values[b]).all() and "logprobs" not in records[b]
            continue
        np.testing.assert_allclose(values[b, :n], ref[np.arange(n), tokens[b, :n]],
                                   atol=TOLERANCE)
        best = np.argsort(-ref, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(top_ids[b, :n, :k], best)
        assert (top_ids[b, :, k:] == -1).all()
        entries = records[b]["logprobs"]
        assert [e["token_id"] for e in entries] == tokens[b, :n].tolist()
        np.testing.assert_allclose([e["logprob"] for e in entries], values[b, :n], rtol=1e-6)
        assert [[a["token_id"] for a in e["top_logprobs"]] for e in entries] == best.tolist()
    ref = _reference(model, PROMPTS[3], [])
    t = np.arange(1, len(PROMPTS[3]))
    np.testing.assert_allclose(prompt_values[3, t], ref[t - 1, PROMPTS[3][t]], atol=TOLERANCE)
    assert np.isnan(np.delete(prompt_values, 3, axis=0)).all()
    prompt_entries = records[3]["prompt_logprobs"]
    assert prompt_entries[0] is None and len(prompt_entries) == len(PROMPTS[3])
    assert [e["token_id"] for e in prompt_entries[1:]] == PROMPTS[3][1:].tolist()
    assert "prompt_logprobs" not in records[0]


@pytest.mark.parametrize("sets, message", [
    (["generate.logprobs=21"], "generate.logprobs must be in [0, 20]"),
    (["generate.prompt_logprobs=-1"], "generate.prompt_logprobs must be in [0, 20]"),
])
def test_logprobs_that_cannot_be_given_are_refused(llama, capfd, sets, message):
    _, path = llama
    assert message in refused(capfd, lambda: generate_here(path, 4, *sets))


@pytest.mark.slow
def test_prompt_logprobs_under_cp_are_one_line_before_any_work(llama, tmp_path):
    _, path = llama
    proc = mpirun(2, ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts",
                      "random", "--max-new-tokens", "4", "--cp", "2", "--prompt-logprobs", "0",
                      "--out", "o.jsonl"], tmp_path)[0]
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "cp 2 with prompt_logprobs" in errors[0], proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("value, message", [
    ("true", '"logprobs" must be an integer, got true'),
    ("2.0", '"logprobs" must be an integer, got 2.0'),
    ("30", "logprobs must be in [0, 20]")])
def test_a_lines_logprobs_must_be_a_count(llama, tmp_path, capfd, value, message):
    _, path = llama
    (tmp_path / "p.jsonl").write_text(f'{{"ids": [1, 2], "logprobs": {value}}}\n')
    job = load_job(None, [f"model.checkpoint='{path}'", f"data.prompts='{tmp_path / 'p.jsonl'}'"])
    error = refused(capfd, lambda: run_generation(MPI.COMM_SELF, job, progress=False))
    assert "p.jsonl:1: " in error and message in error


@pytest.mark.device
def test_no_token_copies_the_vocabulary_to_the_host(llama, monkeypatch):
    """Every array a generation with log-probs (K 5, sampled with top-k, penalties) reads
    back to the host holds a few numbers per row, never a row of the vocabulary."""
    from hpcpar.parallel.device.backend import ArrayBackend
    _, path = llama
    widths = []
    to_host = ArrayBackend.to_host

    def recording(self, a):
        widths.append(a.shape[-1] if getattr(a, "ndim", 0) >= 2 else 1)
        return to_host(self, a)

    monkeypatch.setattr(ArrayBackend, "to_host", recording)
    ours = generate_here(path, 6, f"generate.logprobs={K}", "generate.temperature=0.9",
                 "generate.top_k=8", "generate.repetition_penalty=1.2", "generate.seed=1")
    assert ours.logprobs is not None and widths
    assert max(widths) <= 8, max(widths)                # top-k 8 candidates; vocabulary 250
