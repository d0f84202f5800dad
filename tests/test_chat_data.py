"""Fine-tuning on chat data: the loss on the assistant's tokens only.

The mask of a conversation is transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` where the template marks ``{% generation %}``, and the
tokens each assistant turn adds to the rendering of the messages before it (with the
generation prompt) where it does not; a step on masked rows (conversations, ``{"ids",
"labels"}`` with -100, a row cut to ``--seq-len``) gives transformers' loss
(``model(ids, labels=labels).loss``: the mean over every unmasked label of the global batch),
gradient norm and SGD update, on one rank with two micro-batches and under dp 2 (2 ranks) and
pp 2 x tp 2 (4 ranks); bad input is one error naming the file and line, exit 2."""

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import build_hf_model, hpcpar_here, made_once, save_word_tokenizer  # noqa: E402
from hpcpar.checkpoint import convert, open_checkpoint  # noqa: E402
from hpcpar.jobs.inputs.stage import load_tokenizer  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402
from hpcpar.jobs.train.chat_data import conversation_row, prompt_completion_row  # noqa: E402
from hpcpar.jobs.train.data import load_dataset  # noqa: E402
from hpcpar.jobs.train.engine import run_training  # noqa: E402
from hpcpar.models.chat import ChatTemplate  # noqa: E402
from hpcpar.parallel.errors import HpcparError  # noqa: E402

# a BOS, a header per message, the assistant's answer and its end marked for training
MARKED = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}\n{% else %}{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CHATS = [
    [{"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": "w8 w9"}],
    [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w9 w10"},
     {"role": "assistant", "content": "w11 w12 w13"}, {"role": "user", "content": "w14"},
     {"role": "assistant", "content": "w15"}],
    [{"role": "user", "content": "w20"}, {"role": "assistant", "content": ""}],
]
SEQ_LEN = 24


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """transformers' tokenizer with the marked template and with the plain one."""
    folder = tmp_path_factory.mktemp("tokenizers")
    return {name: save_word_tokenizer(folder / name, template)
            for name, template in (("marked", MARKED), ("plain", PLAIN))}


def _hf_mask(tok, chat) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _ours(tok, source, chat):
    ids, labels = conversation_row(chat, tok.backend_tokenizer,
                                   ChatTemplate(source, {"bos_token": tok.bos_token}), "x:1")
    return ids.tolist(), (labels != -100).astype(int).tolist()


def test_a_marked_templates_mask_is_transformers_assistant_mask(tokenizers):
    tok = tokenizers["marked"]
    for chat in CHATS:
        ids, mask = _ours(tok, MARKED, chat)
        assert (ids, mask) == _hf_mask(tok, chat)
    assert sum(_hf_mask(tok, CHATS[1])[1]) == 6              # w11 w12 w13 <|end|> w15 <|end|>


def test_without_markers_the_mask_is_what_each_assistant_turn_adds(tokenizers):
    tok = tokenizers["plain"]
    for chat in CHATS:
        ids = tok.apply_chat_template(chat)["input_ids"]
        want = [0] * len(ids)
        for k, m in enumerate(chat):
            if m["role"] == "assistant":
                start = len(tok.apply_chat_template(chat[:k], add_generation_prompt=True)
                            ["input_ids"])
                end = len(tok.apply_chat_template(chat[:k + 1])["input_ids"])
                want[start:end] = [1] * (end - start)
        assert _ours(tok, PLAIN, chat) == (list(ids), want)


def test_prompt_and_completion_are_taken_as_trl_takes_them(tokenizers):
    """Messages: the loss on what the completion adds to the prompt rendered with the
    generation prompt; strings: on the tokens after the prompt's own, EOS added."""
    tok = tokenizers["plain"]
    cfg = SimpleNamespace(eos_token_id=(tok.eos_token_id,))
    chat = ChatTemplate(PLAIN, {"bos_token": tok.bos_token})
    prompt, completion = CHATS[1][:4], CHATS[1][4:]
    ids, labels = prompt_completion_row({"prompt": prompt, "completion": completion}, cfg,
                                        tok.backend_tokenizer, chat, "x:1")
    whole = list(tok.apply_chat_template(prompt + completion)["input_ids"])
    head = len(tok.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"])
    assert ids.tolist() == whole and labels.tolist() == [-100] * head + whole[head:]
    ids, labels = prompt_completion_row({"prompt": "w1 w2", "completion": " w3 w4"}, cfg,
                                        tok.backend_tokenizer, chat, "x:2")
    want = tok("w1 w2 w3 w4")["input_ids"] + [tok.eos_token_id]
    assert ids.tolist() == want and labels.tolist() == [-100, -100, *want[2:]]


# ---- training on masked rows, against transformers ---------------------------------------

def _model_folder() -> Path:
    """A tiny random Llama with the word tokenizer and the marked template, converted; and
    the step's data: conversations, ids with labels, a row longer than SEQ_LEN + 1."""
    def build(folder):
        build_hf_model("gqa-llama3", folder, num_hidden_layers=2)
        save_word_tokenizer(folder / "hf", MARKED)
        convert(folder / "hf", folder / "model.h5")
        rng = np.random.default_rng(0)
        ids = rng.integers(5, 245, 9).tolist()
        labels = [-100] * 4 + ids[4:]
        long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40, 50))},
                {"role": "assistant", "content": " ".join(f"w{i}" for i in range(50, 70))}]
        lines = [{"messages": CHATS[0]}, {"ids": ids, "labels": labels},
                 {"messages": long}, {"messages": CHATS[1]},     # long: cut in the answer
                 {"ids": [7, 8, 9], "labels": [-100, -100, -100]}]     # nothing to learn
        (folder / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return made_once("test_chat_data model", build)


def _reference(folder: Path, lr: float):
    """transformers' loss, gradient norm and SGD-updated weights for the file's rows (cut to
    SEQ_LEN + 1 tokens, the row without a label left out) as one right-padded batch."""
    tok = transformers.AutoTokenizer.from_pretrained(folder / "hf")
    rows = []
    for line in (folder / "chat.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "messages" in record:
            ids, mask = _hf_mask(tok, record["messages"])
            labels = [t if m else -100 for t, m in zip(ids, mask)]
        else:
            ids, labels = record["ids"], record["labels"]
        ids, labels = ids[:SEQ_LEN + 1], labels[:SEQ_LEN + 1]
        if any(t != -100 for t in labels[1:]):
            rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf").float().train()
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    weights = {n: p.detach().numpy() for n, p in model.state_dict().items()}
    return loss.item(), norm, weights, int((labels[:, 1:] != -100).sum())


def _train(comm, folder: Path, out: Path, *layout: str):
    job = load_job(None, [
        f"model.checkpoint='{folder}/model.h5'", f"data.dataset='{folder}/chat.jsonl'",
        f"output.path='{out}'", "train.steps=1", "train.global_batch=4",
        f"train.seq_len={SEQ_LEN}", "train.long_rows='cut'", "train.optimizer='sgd'",
        "train.lr=0.5", "train.peak_tflops=1.0", *layout])
    return run_training(comm, job, progress=False)


def _assert_as_transformers(folder: Path, out: Path, report) -> None:
    loss, norm, weights, loss_tokens = _reference(folder, 0.5)
    metrics = json.loads((out / "metrics.jsonl").read_text())
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics["loss_tokens"] == report.loss_tokens == loss_tokens
    with h5py.File(out / "step-1.h5") as f:
        for name, dset in f.items():
            if isinstance(dset, h5py.Dataset):
                np.testing.assert_allclose(dset[()], weights[name], rtol=1e-5, atol=1e-6,
                                           err_msg=name)
    assert (f"1 row cut to {SEQ_LEN + 1} tokens; 1 row with nothing to learn skipped"
            in report.data)
    assert f"{loss_tokens} of {4 * SEQ_LEN} tokens carried the loss" in report.format()


@pytest.mark.device
def test_a_masked_step_with_two_micro_batches_is_transformers(tmp_path):
    folder = _model_folder()
    report = _train(MPI.COMM_SELF, folder, tmp_path / "run", "parallel.micro_batches=2")
    _assert_as_transformers(folder, tmp_path / "run", report)


@pytest.mark.device
@pytest.mark.mpi(ranks=(2, 4))             # dp 2 x 2 micro-batches; pp 2 x tp 2
def test_a_masked_step_under_dp_and_under_pp_and_tp_is_transformers(tmp_path_factory):
    comm = MPI.COMM_WORLD
    folder = out = None
    if comm.Get_rank() == 0:
        folder, out = _model_folder(), tmp_path_factory.mktemp("chat-mpi") / "run"
    folder, out = (Path(p) for p in comm.bcast((str(folder), str(out)), root=0))
    layout = (["parallel.dp=2", "parallel.micro_batches=2"] if comm.Get_size() == 2 else
              ["parallel.pp=2", "parallel.tp=2", "parallel.micro_batches=2"])
    report = _train(comm, folder, out, *layout)
    if comm.Get_rank() == 0:
        _assert_as_transformers(folder, out, report)
    comm.Barrier()


# ---- bad input ---------------------------------------------------------------------------

NO_ASSISTANT = PLAIN.replace("{% if m['role'] == 'assistant' %}",
                             "{% if m['role'] == 'assistant' %}{% continue %}")
# a template that refuses roles out of order, as many do (Llama 2's, Mistral's)
ALTERNATING = PLAIN.replace(
    "{% for m in messages %}",
    "{% for m in messages %}{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}")


@pytest.mark.parametrize("line, words, template", [
    ({"text": "w1 w2"}, 'holds "messages", or "prompt" and "completion", or "ids" and '
                        '"labels" (one of them); this one has keys "text"', None),
    ({"messages": [{"role": "user", "content": "w1"}]}, 'no message has the role "assistant"',
     None),
    ({"ids": [5, 6, 7], "labels": [-100, 6]}, "2 labels for 3 ids", None),
    ({"ids": [5, 250, 7], "labels": [-100, 6, 7]}, "token id 250 is outside the model's "
                                                    "vocabulary [0, 250)", None),
    ({"ids": [5, 6, 7], "labels": [-1, 6, 7]}, "label -1 is neither a token id", None),
    ({"prompt": "w1", "completion": ["w2"]}, '"prompt" and "completion" must be two strings '
                                             'or two lists of messages', None),
    ({"messages": CHATS[0]}, "the chat template renders nothing of the assistant's message",
     NO_ASSISTANT),
    ({"messages": CHATS[0][::-1]}, "the chat template refused the conversation: Conversation "
                                   "roles must alternate user/assistant", ALTERNATING),
])
def test_bad_fine_tuning_lines_are_one_error_naming_the_line(tmp_path, line, words, template):
    folder = _model_folder()
    ckpt = open_checkpoint(folder / "model.h5")
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"ids": [5, 6, 7], "labels": [-100, 6, 7]}) + "\n"
                    + json.dumps(line) + "\n")
    chat = (ChatTemplate(template, {"bos_token": "<s>"}) if template else
            ChatTemplate.from_files(ckpt.tokenizer_files()))
    with pytest.raises(HpcparError) as e:
        load_dataset(data, ckpt.config, 16, load_tokenizer(ckpt), chat)
    assert str(e.value).startswith(f"{data}:2: ") and words in str(e.value), str(e.value)


def test_a_row_longer_than_seq_len_is_refused_before_any_work(tmp_path):
    folder = _model_folder()
    done = hpcpar_here(["train", "--checkpoint", folder / "model.h5", "--data",
                        folder / "chat.jsonl", "--seq-len", "8", "--steps", "1",
                        "--global-batch", "2", "--out", tmp_path / "out"], tmp_path)
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and f"{folder / 'chat.jsonl'}:1: the row has 12 tokens, more than " \
        "the 9 a sample holds" in errors[0] and "--long-rows cut" in errors[0], errors
    assert not (tmp_path / "out").exists()
