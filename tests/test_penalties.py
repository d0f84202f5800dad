"""Penalties and min-p, each with the meaning of the library that named it: greedy tokens with
transformers' repetition penalty equal its ``generate``'s; OpenAI's presence and frequency
penalties equal a step-by-step reference on transformers' logits; min-p keeps what
transformers' ``MinPLogitsWarper`` keeps; the same tokens under tp and pp; per-line settings
and their errors."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import PROMPTS, build_hf_model, generate_here, hpcpar_here, mpirun  # noqa: E402
from hpcpar.jobs.generate.sampling import candidate_probabilities  # noqa: E402
from hpcpar.jobs.inputs.sampling_settings import PromptSampling, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_hf_model("gqa-llama3", tmp_path_factory.mktemp("penalties"))




@pytest.mark.device
@pytest.mark.parametrize("penalty", [1.3, 0.6])
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_greedy_with_a_repetition_penalty_gives_transformers_generate(llama, penalty, batching):
    model, path = llama
    n = 12
    ours = generate_here(path, n, f"generate.repetition_penalty={penalty}",
                 f"generate.batching='{batching}'")
    plain = generate_here(path, n)
    changed = 0
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt[None]), max_new_tokens=n, do_sample=False,
                                 repetition_penalty=penalty,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert ours.tokens[b].tolist() == out[0, len(prompt):].tolist(), b
        changed += ours.tokens[b].tolist() != plain.tokens[b].tolist()
    assert changed, "the penalty changed no row: the test would pass without it"


@pytest.mark.device
def test_presence_and_frequency_penalties_are_openais(llama):
    """Against a reference written from OpenAI's definition: at each step, transformers'
    logits of the whole sequence, minus presence x [generated before] and frequency x (times
    generated), then the argmax."""
    model, path = llama
    n, presence, frequency = 10, 0.8, 0.5
    ours = generate_here(path, n, f"generate.presence_penalty={presence}",
                 f"generate.frequency_penalty={frequency}")
    for b, prompt in enumerate(PROMPTS):
        ids, generated = list(prompt), []
        for _ in range(n):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
            counts = np.bincount(generated, minlength=len(logits)) if generated else 0
            logits = logits - presence * (np.asarray(counts) > 0) - frequency * counts
            generated.append(int(np.argmax(logits)))
            ids.append(generated[-1])
        assert ours.tokens[b].tolist() == generated, b


def test_min_p_keeps_what_transformers_min_p_keeps():
    """A fixed distribution over 40 candidates, several temperatures, top-k and top-p: the
    candidates min-p keeps, and their renormalized probabilities, are transformers'."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    rng = np.random.default_rng(3)
    values = np.sort(rng.normal(0, 1, (1, 40)))[:, ::-1].copy()
    cut = []
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.2),
                                             (1.5, 12, 1.0, 0.1), (1.0, 0, 0.9, 0.3),
                                             (0.5, 20, 0.95, 0.01)]:
        p = PromptSampling.build(SamplingParams(temperature, top_k, top_p, 0, min_p=min_p),
                                 [{}])
        ours = candidate_probabilities(values, p)[0]
        scores = torch.tensor(values)
        for warper in [TemperatureLogitsWarper(temperature)] + (
                [TopKLogitsWarper(top_k)] if top_k else []) + (
                [TopPLogitsWarper(top_p)] if top_p < 1 else []) + [MinPLogitsWarper(min_p)]:
            scores = warper(None, scores)
        theirs = torch.softmax(scores.double(), -1)[0].numpy()
        np.testing.assert_array_equal(ours > 0, theirs > 0)
        np.testing.assert_allclose(ours, theirs, atol=1e-12)
        before = candidate_probabilities(values, PromptSampling.build(
            SamplingParams(temperature, top_k, top_p, 0), [{}]))[0]
        cut.append(int((before > 0).sum() - (ours > 0).sum()))
    assert sum(c > 0 for c in cut) >= 3, cut        # min-p cut where the others left more


@pytest.mark.slow
@pytest.mark.device
def test_penalties_give_the_same_tokens_under_tp_and_pp(llama, tmp_path):
    """Sampled, with all three penalties and min-p: 1 rank, tp 2 and pp 2 agree."""
    _, path = llama
    lines = [{"ids": p.tolist()} for p in PROMPTS]
    lines[1].update(repetition_penalty=1.5, presence_penalty=-0.5)      # a line's own
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    args = ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts", "p.jsonl",
            "--max-new-tokens", "10", "--ignore-eos", "--temperature", "0.9", "--min-p", "0.05",
            "--repetition-penalty", "1.2", "--presence-penalty", "0.4",
            "--frequency-penalty", "0.3", "--seed", "5"]
    tokens = []
    for n, layout in ((1, []), (2, ["--tp", "2"]), (2, ["--pp", "2"])):
        proc, _ = mpirun(n, [*args, *layout, "--out", f"o{n}{''.join(layout)}.jsonl"],
                         tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = tmp_path / f"o{n}{''.join(layout)}.jsonl"
        tokens.append([json.loads(line)["token_ids"] for line in out.read_text().splitlines()])
    assert tokens[0] == tokens[1] == tokens[2]


@pytest.mark.parametrize("line, words", [
    ({"ids": [5, 6], "repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"ids": [5, 6], "presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
    ({"ids": [5, 6], "frequency_penalty": "high"}, "\"frequency_penalty\" must be a number"),
    ({"ids": [5, 6], "min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"ids": [5, 6], "min_tokens": 10 ** 30}, "min_tokens must be >= 0 (0: none) and below 2^63"),
    ({"ids": [5, 6], "repetition_penalty": 10 ** 400}, "and below 2^63"),
    ({"ids": [5, 6], "min_p": 0.5}, "bad.jsonl: prompt 0 sets min_p, which cut the candidates"),
    ({"ids": [5, 6], "stop_token_ids": [10 ** 20]}, "stop_token_ids\" must be a list of token"),
])
def test_a_bad_penalty_on_a_line_is_one_error(llama, tmp_path, line, words):
    _, path = llama
    (tmp_path / "bad.jsonl").write_text(json.dumps(line) + "\n")
    proc = hpcpar_here(["generate", "--checkpoint", path, "--prompts", "bad.jsonl",
                        "--max-new-tokens", "4", "--out", "o.jsonl"], tmp_path)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "bad.jsonl" in lines[0] and words in lines[0], proc.stderr


@pytest.mark.slow
def test_min_p_with_every_prompt_greedy_is_refused(llama, tmp_path):
    _, path = llama
    proc, _ = mpirun(1, ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts",
                         "random", "--max-new-tokens", "4", "--stop-token-id", "-1", "--out",
                         "o.jsonl"], tmp_path)
    assert proc.returncode == 2
    assert "--stop-token-id: generate.stop_token_ids must be >= 0" in proc.stderr
    proc, _ = mpirun(1, ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts",
                         "random", "--max-new-tokens", "4", "--min-p", "0.1", "--out",
                         "o.jsonl"], tmp_path)
    assert proc.returncode == 2 and "min_p" in proc.stderr and "greedy" in proc.stderr


@pytest.mark.device
def test_min_tokens_and_stop_token_ids_are_transformers_min_new_tokens_and_eos(llama):
    """A stop id a row would generate soon, and min_tokens 4: the id is banned for the first
    4 tokens, then ends the row (finish reason "stop"), as transformers' generate with that
    id as its EOS and min_new_tokens 4 does; without min_tokens the rows end sooner."""
    model, path = llama
    n = 12
    plain = generate_here(path, n)
    stop = int(plain.tokens[0, 1])                  # prompt 0's second greedy token
    runs = {(k, b): generate_here(path, n, f"generate.stop_token_ids=[{stop}]",
                          f"generate.min_tokens={k}", f"generate.batching='{b}'")
            for k, b in ((0, "continuous"), (4, "continuous"), (4, "static"))}
    for (k, _), ours in runs.items():
        for b, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                out = model.generate(torch.tensor(prompt[None]), max_new_tokens=n,
                                     do_sample=False, eos_token_id=[stop], pad_token_id=0,
                                     min_new_tokens=k,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            theirs = out[0, len(prompt):].tolist()
            if stop in theirs:
                theirs = theirs[:theirs.index(stop) + 1]
            length = int(ours.lengths[b])
            assert ours.tokens[b, :length].tolist() == theirs, (k, b)
            assert ours.finish_reasons[b] == ("stop" if theirs[-1] == stop else "length")
    soon = plain.tokens[0].tolist().index(stop) + 1            # where the id comes first
    assert soon <= 2 and runs[(0, "continuous")].lengths[0] == soon
    assert runs[(4, "continuous")].lengths[0] > 4


@pytest.mark.slow
@pytest.mark.device
def test_stop_token_ids_of_a_line_replace_the_jobs(llama, tmp_path):
    _, path = llama
    plain = generate_here(path, 8)
    first = [int(plain.tokens[b, 0]) for b in range(2)]
    lines = [{"ids": PROMPTS[0].tolist(), "stop_token_ids": [first[0]]},
             {"ids": PROMPTS[1].tolist()}]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc, _ = mpirun(1, ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts",
                         "p.jsonl", "--max-new-tokens", "8", "--ignore-eos", "--stop-token-id",
                         str(first[1]), "--out", "o.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == [[first[0]], [first[1]]]
    assert [r["finish_reason"] for r in rows] == ["stop", "stop"]
    bad = {"ids": [5], "stop_token_ids": [10 ** 6]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    proc, _ = mpirun(1, ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts",
                         "bad.jsonl", "--max-new-tokens", "8", "--out", "b.jsonl"], tmp_path)
    assert proc.returncode == 2 and "is not a token id of this model" in proc.stderr
    proc, _ = mpirun(1, ["-m", "hpcpar", "generate", "--checkpoint", str(path), "--prompts",
                         "p.jsonl", "--max-new-tokens", "8", "--min-tokens", "9", "--out",
                         "c.jsonl"], tmp_path)
    assert proc.returncode == 2 and "min_tokens 9, more than its max_new_tokens 8" in proc.stderr
