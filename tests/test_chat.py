"""Conversations as prompts: a ``{"messages": [...]}`` line is rendered with the checkpoint's
own chat template and tokenized exactly as transformers' ``apply_chat_template`` does
(``add_generation_prompt=True``), from ``tokenizer_config.json`` or ``chat_template.jinja``;
a checkpoint without a template, a bad conversation and a template that refuses it are one
error each."""

import json
import re
import shutil

import numpy as np
import pytest
from mpi4py import MPI

transformers = pytest.importorskip("transformers")

from helpers import GQA, realistic_tensors, save_word_tokenizer, write_hf_checkpoint  # noqa: E402
from hpcpar.checkpoint import convert  # noqa: E402
from hpcpar.parallel.errors import HpcparError  # noqa: E402
from hpcpar.jobs.generate import run_generation  # noqa: E402
from hpcpar.models.chat import ChatTemplate  # noqa: E402
from hpcpar.jobs.inputs.prompts import load_prompts  # noqa: E402
from hpcpar.jobs.inputs.stage import load_tokenizer  # noqa: E402
from hpcpar.checkpoint import open_checkpoint  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402

# Llama 3's shape: a BOS, a header per message, the generation prompt, a loop control and
# the helpers transformers gives templates
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user or assistant') }}{% endif %}"
    "{% if m['content'] == '' %}{% continue %}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
CHATS = [
    [{"role": "user", "content": "w5 w6 w7"}],
    [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": " w9 w10 "},
     {"role": "assistant", "content": "w11"}, {"role": "user", "content": ""},
     {"role": "user", "content": "w12 w13 w14"}],
]


def _tokenizer_folder(folder, template_in: str):
    """A word-level tokenizer with special tokens, saved by transformers with the template
    in tokenizer_config.json or chat_template.jinja."""
    save_word_tokenizer(folder, TEMPLATE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    jinja = folder / "chat_template.jinja"
    if template_in == "tokenizer_config.json":
        config["chat_template"] = TEMPLATE
        jinja.unlink(missing_ok=True)
    else:
        config.pop("chat_template", None)
        jinja.write_text(TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=["tokenizer_config.json", "chat_template.jinja"])
def chat_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    write_hf_checkpoint(folder / "hf", GQA, extra=realistic_tensors(GQA, 0))
    theirs = _tokenizer_folder(folder / "hf", request.param)
    convert(folder / "hf", folder / "model.h5")
    return folder, theirs


def test_conversations_render_and_tokenize_as_apply_chat_template(chat_model, tmp_path):
    folder, theirs = chat_model
    lines = tmp_path / "chats.jsonl"
    lines.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    ckpt = open_checkpoint(folder / "model.h5")
    prompts = load_prompts(lines, load_tokenizer(ckpt),
                           ChatTemplate.from_files(ckpt.tokenizer_files()))
    for chat, ids, text in zip(CHATS, prompts.ids, prompts.texts):
        want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ids.tolist() == list(want)
        assert text == theirs.apply_chat_template(chat, add_generation_prompt=True,
                                                  tokenize=False)
    assert prompts.ids[0][0] == theirs.bos_token_id         # the template's own BOS, once


@pytest.mark.device
def test_a_conversation_generates_as_its_rendered_ids(chat_model, tmp_path):
    folder, theirs = chat_model
    lines = tmp_path / "chats.jsonl"
    lines.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    want = [theirs.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
            for c in CHATS]
    want = [list(w["input_ids"] if hasattr(w, "keys") else w) for w in want]
    np.save(tmp_path / "ids.npy", np.array(want[0])[None])

    def run(prompts, out):
        return run_generation(MPI.COMM_SELF, load_job(None, [
            f"model.checkpoint='{folder / 'model.h5'}'", f"data.prompts='{prompts}'",
            "generate.max_new_tokens=5", "generate.stop_at_eos=false",
            f"output.path='{tmp_path / out}'"]), progress=False)

    chats, ids = run(lines, "chats.h5"), run(tmp_path / "ids.npy", "ids.h5")
    assert chats.tokens[0].tolist() == ids.tokens[0].tolist()


@pytest.mark.parametrize("line, words", [
    ({"messages": []}, '"messages" must be a non-empty list'),
    ({"messages": [{"role": "user"}]}, 'message 0 must be an object with string "role" and '
                                       '"content"'),
    ({"messages": [{"role": "tool", "content": "w1"}]},
     "the chat template refused the conversation: roles are system, user or assistant"),
    ({"messages": [{"role": "user", "content": "w1"}], "text": "w2"},
     'exactly one of "ids", "text" or "messages"'),
])
def test_a_bad_conversation_is_one_error_naming_the_line(chat_model, tmp_path, line, words):
    folder, _ = chat_model
    ckpt = open_checkpoint(folder / "model.h5")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ids": [5, 6]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(HpcparError, match=f"bad.jsonl:2: .*{re.escape(words)}"):
        load_prompts(bad, load_tokenizer(ckpt), ChatTemplate.from_files(ckpt.tokenizer_files()))


def test_without_a_template_a_conversation_is_one_clear_error(chat_model, tmp_path):
    folder, _ = chat_model
    hf = tmp_path / "hf"
    shutil.copytree(folder / "hf", hf)
    (hf / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    convert(hf, tmp_path / "plain.h5")
    ckpt = open_checkpoint(tmp_path / "plain.h5")
    lines = tmp_path / "chats.jsonl"
    lines.write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    assert ChatTemplate.from_files(ckpt.tokenizer_files()) is None
    with pytest.raises(HpcparError, match="rendered with the checkpoint's chat template, and "
                                          "this checkpoint has none"):
        load_prompts(lines, load_tokenizer(ckpt), None)
    with pytest.raises(HpcparError, match='"messages" lines are conversations for generation'):
        load_prompts(lines, load_tokenizer(ckpt))                  # scoring, training data
