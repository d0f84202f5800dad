"""OpenAI Batch API files in and out: chat and text completions on a tiny model with a chat
template, equal to transformers' greedy ``generate`` on the rendered conversation and to its
``log_softmax``; n choices; per-request error records for what hpcpar cannot serve while the
others run; exit status 5 then; input order; a killed run resumed to the same lines."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import build_hf_model, mpirun, save_word_tokenizer  # noqa: E402
from hpcpar.checkpoint import convert  # noqa: E402

# processes of their own: the whole suite's tier, not tests/run --quick
pytestmark = pytest.mark.slow

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n"
            "{{ m['content'] | trim }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
MAX_NEW = 6


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A transformers Llama with a word-level tokenizer and a chat template, converted."""
    folder = tmp_path_factory.mktemp("batch")
    model, _ = build_hf_model("gqa-llama3", folder)
    save_word_tokenizer(folder / "hf", TEMPLATE)
    convert(folder / "hf", folder / "chat.h5")
    return model, transformers.AutoTokenizer.from_pretrained(folder / "hf"), folder / "chat.h5"


def _request(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"
REQUESTS = [
    _request("chat-1", CHAT, model="tiny", messages=[{"role": "user", "content": "w5 w6 w7"}],
             max_completion_tokens=MAX_NEW, temperature=0, top_p=1, logprobs=True,
             top_logprobs=2),
    _request("bad-url", "/v1/embeddings", model="tiny", input="w1"),
    _request("text-1", COMPLETION, model="tiny", prompt="w9 w10 w11", max_tokens=4,
             temperature=0, logprobs=1),
    _request("tools", CHAT, messages=[{"role": "user", "content": "w1"}], tools=[]),
    _request("sampled", CHAT, messages=[{"role": "system", "content": "w1 w2"},
                                        {"role": "user", "content": "w3"}],
             n=3, temperature=1.0, seed=7, max_tokens=MAX_NEW),
    _request("too-many", CHAT, messages=[{"role": "user", "content": "w4"}], max_tokens=500),
    _request("ids", COMPLETION, prompt=[1, 20, 21, 22], stop=None, stream=False),
    _request("top-25", CHAT, messages=[{"role": "user", "content": "w4"}], logprobs=True,
             top_logprobs=25),
    # greedy at the job's temperature, a neutral top_p: served (OpenAI clients send it)
    _request("greedy-top-p", COMPLETION, prompt="w9 w10 w11", max_tokens=4, top_p=1.0,
             top_k=-1),
    # two requests alike with their own seed: the same draws, wherever they are
    _request("seeded-a", COMPLETION, prompt="w30 w31", temperature=1.0, seed=11),
    _request("seeded-b", COMPLETION, prompt="w30 w31", temperature=1.0, seed=11),
    _request("top-alone", CHAT, messages=[{"role": "user", "content": "w4"}], top_logprobs=2),
]
FAILED = {"bad-url": "url '/v1/embeddings' is not served",
          "tools": "'tools' is not supported by hpcpar's /v1/chat/completions",
          "too-many": "max_tokens 500, more than the job's 6",
          "top-25": "top_logprobs must be in [0, 20]",
          "top-alone": "\"top_logprobs\" needs \"logprobs\": true"}


def _run(folder, checkpoint, out, *extra, env=None):
    args = ["-m", "hpcpar", "generate", "--checkpoint", str(checkpoint), "--prompts",
            "requests.jsonl", "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--out", out,
            *extra]
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return mpirun(1, args, folder, timeout=120)[0]
    finally:
        os.environ.clear()
        os.environ.update(old)


def _greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        logits = model(out).logits[0, len(ids) - 1:-1].double()
    return out[0, len(ids):].tolist(), torch.log_softmax(logits, -1).numpy()


@pytest.mark.device
def test_a_batch_file_round_trip(chat_model, tmp_path):
    model, theirs, checkpoint = chat_model
    (tmp_path / "requests.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in REQUESTS))
    proc = _run(tmp_path, checkpoint, "out.jsonl")
    assert proc.returncode == 5, proc.stderr             # done, with failed requests
    assert "batch: 12 requests, 7 served, 5 failed" in proc.stdout, proc.stdout
    lines = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in REQUESTS]
    by_id = {line["custom_id"]: line for line in lines}
    for custom_id, words in FAILED.items():
        line = by_id[custom_id]
        assert line["response"] is None and words in line["error"]["message"], line

    # a chat completion: transformers' greedy tokens on apply_chat_template's ids
    chat = by_id["chat-1"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    ids = theirs.apply_chat_template(REQUESTS[0]["body"]["messages"],
                                     add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    tokens, logprobs = _greedy(model, ids, MAX_NEW)
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant",
                                 "content": theirs.decode(tokens, skip_special_tokens=True)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": MAX_NEW,
                             "total_tokens": len(ids) + MAX_NEW}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [theirs.decode([t]) for t in tokens]
    np.testing.assert_allclose([c["logprob"] for c in content],
                               logprobs[np.arange(MAX_NEW), tokens], atol=2e-5)
    for c, row in zip(content, logprobs):
        best = np.argsort(-row, kind="stable")[:2]
        assert [a["token"] for a in c["top_logprobs"]] == [theirs.decode([t]) for t in best]
        assert c["bytes"] == list(c["token"].encode())

    # a text completion: the prompt encoded with its BOS, as transformers' tokenizer does
    text = by_id["text-1"]["response"]["body"]
    assert text["object"] == "text_completion"
    ids = theirs("w9 w10 w11")["input_ids"]
    tokens, logprobs = _greedy(model, ids, 4)
    (choice,) = text["choices"]
    assert choice["text"] == theirs.decode(tokens, skip_special_tokens=True)
    assert choice["logprobs"]["tokens"] == [theirs.decode([t]) for t in tokens]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"],
                               logprobs[np.arange(4), tokens], atol=2e-5)
    assert choice["logprobs"]["text_offset"] == [
        len(theirs.decode(tokens[:t], skip_special_tokens=True)) for t in range(4)]
    assert text["usage"]["completion_tokens"] == 4

    # n choices of one prompt: three draws, each its own
    sampled = by_id["sampled"]["response"]["body"]
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in sampled["choices"]}) == 3
    assert sampled["usage"]["completion_tokens"] == 3 * MAX_NEW
    assert by_id["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 4
    assert (by_id["greedy-top-p"]["response"]["body"]["choices"][0]["text"]
            == text["choices"][0]["text"])
    assert (by_id["seeded-a"]["response"]["body"]["choices"]
            == by_id["seeded-b"]["response"]["body"]["choices"])
    assert by_id["ids"]["response"]["body"]["choices"][0]["logprobs"] is None    # not asked

    # the output is hpcpar's: run again into it, and read it back with show
    again = _run(tmp_path, checkpoint, "out.jsonl")
    assert again.returncode == 5, again.stderr
    shown = mpirun(1, ["-m", "hpcpar", "show", "out.jsonl"], tmp_path)[0]
    assert shown.returncode == 0, shown.stderr
    assert "12 Batch API requests (5 failed)" in shown.stdout, shown.stdout
    assert "sampled.2" in shown.stdout and "bad-url error" in shown.stdout


def test_a_killed_batch_resumes_to_the_same_lines(chat_model, tmp_path):
    _, _, checkpoint = chat_model
    requests = [_request(f"r{i}", CHAT, messages=[{"role": "user", "content": f"w{i + 3}"}],
                         max_tokens=1 if i % 2 else MAX_NEW, temperature=0.8, seed=i)
                for i in range(8)] + [REQUESTS[1]]
    (tmp_path / "requests.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in requests))
    straight = _run(tmp_path, checkpoint, "straight.jsonl", "--batch-size", "2")
    assert straight.returncode == 5, straight.stderr
    killed = _run(tmp_path, checkpoint, "out.jsonl", "--batch-size", "2",
                  env={"HPCPAR_FAULT": "rank=0,phase=decode,step=6,kind=kill",
                       "HPCPAR_SAVE_SECONDS": "0"})
    assert killed.returncode != 0 and not (tmp_path / "out.jsonl").exists()
    assert (tmp_path / ".out.jsonl.partial").exists()
    resumed = _run(tmp_path, checkpoint, "out.jsonl", "--batch-size", "2", "--resume", "auto")
    assert resumed.returncode == 5, resumed.stderr

    def lines(name):
        out = [json.loads(line) for line in open(tmp_path / name)]
        for line in out:
            if line["response"]:
                del line["response"]["body"]["created"]
        return out

    assert lines("out.jsonl") == lines("straight.jsonl")


@pytest.mark.parametrize("lines, words", [
    ([_request("a", CHAT, messages=[]), {"ids": [1, 2]}], "holds requests only"),
    ([_request("a", CHAT, messages=[]), _request("a", CHAT, messages=[])], "already used"),
    ([_request("a", "/v1/embeddings")], "no request can be served"),
    ([{"custom_id": "a", "method": "POST", "url": CHAT}], "request needs its \"body\""),
    ([{"url": CHAT, "body": {"messages": []}}], "\"custom_id\" must be a non-empty string"),
])
def test_a_batch_file_that_cannot_run_is_one_error(chat_model, tmp_path, lines, words):
    _, _, checkpoint = chat_model
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    proc = _run(tmp_path, checkpoint, "out.jsonl")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_results_need_a_json_lines_output(chat_model, tmp_path):
    _, _, checkpoint = chat_model
    (tmp_path / "requests.jsonl").write_text(json.dumps(REQUESTS[0]) + "\n")
    proc = _run(tmp_path, checkpoint, "out.h5")
    assert proc.returncode == 2 and "write them to a .jsonl" in proc.stderr, proc.stderr


def test_a_batch_file_needs_the_models_tokenizer(tmp_path):
    """A Batch API answer is text: on a checkpoint without a tokenizer even a token-id
    prompt is one error before any work (it ran the whole batch, then failed on the text)."""
    from hpcpar.checkpoint import init_checkpoint
    init_checkpoint(tmp_path / "m.h5", "tiny")
    (tmp_path / "requests.jsonl").write_text(json.dumps(
        _request("a", COMPLETION, prompt=[1, 2, 3], logprobs=1)) + "\n")
    proc = _run(tmp_path, tmp_path / "m.h5", "out.jsonl")
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "the checkpoint holds no tokenizer" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.h5", "requests.jsonl"]
