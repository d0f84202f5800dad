"""Several samples per prompt (``--n N``, a line's ``"n"``): each prompt is prefilled once and
its KV-cache rows copied to its samples; sample s draws from a generator keyed by (seed,
prompt, sample, step), so sample 0 is the one-sample run's, and the result is the same under
both batchings; the output keeps a prompt's samples together (HDF5: a sample axis; JSON
lines: one line per sample naming its prompt and sample)."""

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import PROMPTS, build_hf_model, generate_here, refused  # noqa: E402
from hpcpar.jobs.generate import Prompts, run_generation  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402
from hpcpar.models.decoder import DecoderStage  # noqa: E402

SAMPLED = ["generate.temperature=1.2", "generate.seed=3", "generate.top_k=30"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_hf_model("gqa-llama3", tmp_path_factory.mktemp("samples"))


def _run(path, n, *sets):
    return generate_here(path, 8, f"generate.n={n}", *sets)


@pytest.mark.device
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_greedy_samples_are_each_transformers_greedy_tokens_and_logprobs(llama, batching):
    """Greedy, every sample is the prompt's greedy continuation: its copied KV-cache rows
    decode as the prefilled ones do, and its log-probs are transformers' log-softmax."""
    model, path = llama
    n = 3
    ours = _run(path, n, f"generate.batching='{batching}'", "generate.logprobs=2")
    assert ours.tokens.shape == (len(PROMPTS) * n, 8) and ours.samples.width == n
    for p, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt[None]), max_new_tokens=8, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            logits = model(out).logits[0, len(prompt) - 1:-1].double()
        expected = out[0, len(prompt):].numpy()
        chosen = torch.log_softmax(logits, -1).numpy()[np.arange(8), expected]
        for s in range(n):
            row = p * n + s
            assert ours.tokens[row].tolist() == expected.tolist(), (p, s)
            np.testing.assert_allclose(ours.logprobs.values[row], chosen, atol=2e-5)


@pytest.mark.device
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_sample_zero_is_the_one_sample_run_and_the_others_are_their_own(llama, batching):
    _, path = llama
    one = _run(path, 1, *SAMPLED, f"generate.batching='{batching}'")
    four = _run(path, 4, *SAMPLED, f"generate.batching='{batching}'")
    tokens = four.tokens.reshape(len(PROMPTS), 4, -1)
    np.testing.assert_array_equal(tokens[:, 0], one.tokens)      # keyed by (prompt, step)
    for p in range(len(PROMPTS)):
        assert len({tuple(t) for t in tokens[p].tolist()}) == 4, p    # four different draws
    other = _run(path, 4, *SAMPLED, "generate.batching='static'" if batching == "continuous"
                 else "generate.batching='continuous'")
    np.testing.assert_array_equal(other.tokens, four.tokens)
    few = _run(path, 4, *SAMPLED, "generate.batch_size=3")   # a prompt's samples over refills
    np.testing.assert_array_equal(few.tokens, four.tokens)


@pytest.mark.device
@pytest.mark.parametrize("sets", [["generate.batching='static'"], [],
                                  ["generate.batching='static'", "generate.prompt_logprobs=1"],
                                  ["generate.save_logits=true"]])
def test_a_prompt_is_prefilled_once_for_all_its_samples(llama, monkeypatch, sets):
    """The stage's prefill forwards see one row per prompt, not one per sample; the prompt
    logits and prompt log-probs of every sample are still its prompt's."""
    _, path = llama
    seen = []
    forward = DecoderStage.forward

    def counting(self, x, rows, cache, keep=None):
        if x.shape[1] > 1:
            seen.append(x.shape[0])
        return forward(self, x, rows, cache, keep)

    monkeypatch.setattr(DecoderStage, "forward", counting)
    n = 5
    result = _run(path, n, *SAMPLED, *sets, "parallel.micro_batches=1")
    assert sum(seen) == len(PROMPTS), seen
    monkeypatch.setattr(DecoderStage, "forward", forward)
    one = _run(path, 1, *SAMPLED, *sets, "parallel.micro_batches=1")
    np.testing.assert_array_equal(result.tokens[::n], one.tokens)
    if result.prompt_logits is not None:
        np.testing.assert_array_equal(result.prompt_logits, one.prompt_logits)  # per prompt
    if result.prompt_logprobs is not None:
        np.testing.assert_array_equal(result.prompt_logprobs.values,
                                      np.repeat(one.prompt_logprobs.values, n, axis=0))


@pytest.mark.device
def test_a_lines_own_n_in_hdf5_and_json_lines(llama, tmp_path):
    """n 3 for the job, a line's own 1 and 2: HDF5 has [prompts, 3, ...] with ``samples``,
    the rows past a prompt's n empty; JSON lines one per sample, in order."""
    _, path = llama
    lines = [{"ids": p.tolist()} for p in PROMPTS]
    lines[1]["n"], lines[3]["n"] = 1, 2
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = {}
    for out in ("o.h5", "o.jsonl"):
        job = load_job(None, [f"model.checkpoint='{path}'", "generate.max_new_tokens=5",
                              "generate.stop_at_eos=false", "generate.n=3", *SAMPLED,
                              f"data.prompts='{tmp_path / 'p.jsonl'}'",
                              f"output.path='{tmp_path / out}'"])
        results[out] = run_generation(MPI.COMM_SELF, job, progress=False)
    counts = [3, 1, 3, 2, 3]
    with h5py.File(tmp_path / "o.h5") as f:
        assert f["tokens"].shape == (5, 3, 5) and f["lengths"].shape == (5, 3)
        assert f["samples"][()].tolist() == counts
        assert f["prompt_lengths"][()].tolist() == [len(p) for p in PROMPTS]
        lengths, tokens = f["lengths"][()], f["tokens"][()]
        reasons = f["finish_reason"][()].astype(str)
    present = np.arange(3)[None, :] < np.array(counts)[:, None]
    assert (lengths[present] == 5).all() and (lengths[~present] == 0).all()
    assert (reasons[~present] == "").all() and (reasons[present] == "length").all()
    records = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    assert [(r["index"], r["sample"]) for r in records] == [
        (p, s) for p, c in enumerate(counts) for s in range(c)]
    for r in records:
        assert r["token_ids"] == tokens[r["index"], r["sample"]].tolist()
    np.testing.assert_array_equal(results["o.h5"].tokens, results["o.jsonl"].tokens)


@pytest.mark.parametrize("line, message", [
    ('{"ids": [1, 2], "n": 0}', "n must be in [1, 1024]"),
    ('{"ids": [1, 2], "n": true}', '"n" must be an integer, got true'),
    ('{"ids": [1, 2], "n": 1.5}', '"n" must be an integer, got 1.5'),
])
def test_a_bad_n_is_one_error(llama, tmp_path, capfd, line, message):
    _, path = llama
    (tmp_path / "p.jsonl").write_text(line + "\n")
    job = load_job(None, [f"model.checkpoint='{path}'", f"data.prompts='{tmp_path / 'p.jsonl'}'"])
    assert message in refused(capfd, lambda: run_generation(MPI.COMM_SELF, job,
                                                             progress=False))
    assert "generate.n must be in [1, 1024]" in refused(capfd, lambda: _run(path, 0))


@pytest.mark.device
def test_saved_prompt_logits_are_once_per_prompt(llama, tmp_path):
    """--save-logits with n 3: ``prompt_logits`` [prompts, seq, vocab], the one-sample file's."""
    _, path = llama
    for n in (1, 3):
        job = load_job(None, [f"model.checkpoint='{path}'", "generate.max_new_tokens=3",
                              f"generate.n={n}", "generate.save_logits=true",
                              f"output.path='{tmp_path / f'n{n}.h5'}'"])
        run_generation(MPI.COMM_SELF, job, prompts=Prompts(PROMPTS), progress=False)
    with h5py.File(tmp_path / "n1.h5") as one, h5py.File(tmp_path / "n3.h5") as three:
        assert three["prompt_logits"].shape == one["prompt_logits"].shape
        assert three["prompt_logits"].shape[0] == len(PROMPTS)
        np.testing.assert_array_equal(three["prompt_logits"][()], one["prompt_logits"][()])
