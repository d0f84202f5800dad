"""Tokenizer and chat-template files, and what reads them: a damaged stored tokenizer.json or
template (not UTF-8, not parsing, not compiling) is one error naming the checkpoint's stored
file and the line that needed it, and only the jobs that need them fail (generation, scoring
and training on token ids run); a prompt or data line holding invalid Unicode is one error
naming the file and the line; whatever a chat template raises, and a rendering past its time
or size limit (``HPCPAR_TEMPLATE_SECONDS``, ``HPCPAR_TEMPLATE_MB``), is one error naming the
line; ``convert`` refuses damaged files. Every failure: status 2, one line, nothing left."""

import json
import re
import shutil
import time

import h5py
import numpy as np
import pytest

from helpers import GQA, REPO, hpcpar_here, mpirun, realistic_tensors, write_hf_checkpoint
from hpcpar.jobs import settings
from hpcpar.checkpoint import convert, open_checkpoint
from hpcpar.parallel.errors import HpcparError
from hpcpar.models.chat import ChatTemplate
from hpcpar.jobs.inputs.prompts import load_prompts
from hpcpar.jobs.inputs.stage import load_tokenizer
from test_generate_cli import _assert_one_error

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n"
            "{{ m['content'] | trim }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
         "{% endfor %}")                                   # 10^10 silent iterations
DAMAGED = {     # stored file -> content, as a checkpoint converted without checks may hold
    "truncated": {"tokenizer.json": b'{"version": "1.0", "truncated'},
    "not-utf8": {"tokenizer.json": b'\xff\xfe{"version": "1.0"}'},
    "template-not-utf8": {"chat_template.jinja": b"\xff{{ bos_token }}"},
    "template-syntax": {"chat_template.jinja": b"{% for m in messages %}{{ m.content }}"},
    "config-not-json": {"chat_template.jinja": None, "tokenizer_config.json": b"{nope"},
    "all": {"tokenizer.json": b"[", "chat_template.jinja": b"\xff",
            "tokenizer_config.json": b"{nope"},
    "loops": {"chat_template.jinja": LOOPS.encode()},
    "big": {"chat_template.jinja": b"{% for i in range(100000) %}{{ 'w5 ' * 20 }}{% endfor %}"},
}


def _tokenizer_files(folder):
    """A word-level tokenizer, a chat template and the special tokens, as a Hugging Face
    folder holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>", "<s>", "</s>", "<|start|>", "<|end|>", "user", "assistant"]
    words += [f"w{i}" for i in range(250 - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def _store(source, target, files: dict) -> None:
    """A copy of checkpoint ``source`` whose stored tokenizer files are replaced (None:
    removed)."""
    shutil.copy(source, target)
    with h5py.File(target, "r+") as f:
        group = f["tokenizer"]
        for name, data in files.items():
            if name in group:
                del group[name]
            if data is not None:
                group.create_dataset(name, data=np.frombuffer(data, dtype=np.uint8))


def _lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer-files")
    write_hf_checkpoint(folder / "hf", GQA, extra=realistic_tensors(GQA, 0))
    _tokenizer_files(folder / "hf")
    convert(folder / "hf", folder / "model.h5")
    for name, files in DAMAGED.items():
        _store(folder / "model.h5", folder / f"{name}.h5", files)
    rows = [[5, 6, 7, 8], [9, 10, 11, 12], [100, 3, 4, 8]]
    np.save(folder / "ids.npy", np.array(rows))
    (folder / "ids.jsonl").write_text(_lines(*({"ids": r} for r in rows)))
    (folder / "text.jsonl").write_text(_lines({"text": "w5 w6 w7"}, {"text": "w100 w3"}))
    (folder / "chats.jsonl").write_text(_lines({"messages": [{"role": "user",
                                                             "content": "w5 w6"}]}))
    np.save(folder / "data.npy", np.random.default_rng(0).integers(0, 250, (8, 9)))
    return folder


def _hpcpar(work, n, *args, env=None, timeout=120):
    """``python -m hpcpar ARGS`` under ``mpiexec -n n`` in ``work``, with ``env`` added."""
    import os
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return mpirun(n, ["-m", "hpcpar", *args], work, timeout=timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _generate(work, n, checkpoint, prompts, out, *extra, env=None):
    return _hpcpar(work, n, "generate", "--checkpoint", checkpoint, "--prompts", prompts,
                   "--max-new-tokens", "4", "--ignore-eos", "--out", out, *extra, env=env)[0]


# ---- damaged stored files: only the jobs that need them fail --------------------------------

@pytest.mark.slow
def test_ids_only_jobs_run_on_a_checkpoint_whose_tokenizer_files_are_damaged(work):
    """Generation from .npy ids and {"ids"} lines, scoring and training on ids need neither
    the tokenizer nor the template: they run on a checkpoint whose stored tokenizer.json,
    chat_template.jinja and tokenizer_config.json are all damaged, with the same tokens as on
    the sound checkpoint; the output holds no text, and one note says why."""
    proc = _generate(work, 1, "model.h5", "ids.npy", "sound.h5")
    assert proc.returncode == 0, proc.stderr
    proc = _generate(work, 2, "all.h5", "ids.npy", "ids_npy.h5")
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("hpcpar:")]
    assert len(notes) == 1, proc.stderr
    assert notes[0].startswith("hpcpar: note: all.h5's stored tokenizer.json is not a "
                               "tokenizer the tokenizers library reads ("), notes
    assert notes[0].endswith("); the output holds token ids without their text"), notes
    with h5py.File(work / "sound.h5") as a, h5py.File(work / "ids_npy.h5") as b:
        assert b["tokens"][()].tolist() == a["tokens"][()].tolist()
        assert "text" in a and "text" not in b
    proc = _generate(work, 2, "all.h5", "ids.jsonl", "ids_lines.jsonl", "--dp", "2")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (work / "ids_lines.jsonl").read_text().splitlines()]
    assert [line["text"] for line in lines] == [None] * 3
    proc, _ = _hpcpar(work, 2, "score", "--checkpoint", "all.h5", "--data", "ids.npy",
                      "--out", "scores.h5")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for data, extra in (("data.npy", []), ("ids.jsonl", ["--seq-len", "4"])):
        out = f"run_{data.replace('.', '_')}"
        proc, _ = _hpcpar(work, 2, "train", "--checkpoint", "all.h5", "--data", data,
                          "--steps", "2", "--global-batch", "2", "--out", out, *extra)
        assert proc.returncode == 0, proc.stderr
        assert (work / out / "step-2.h5").is_file()


@pytest.mark.slow
def test_text_runs_on_a_checkpoint_whose_template_is_damaged(work):
    proc = _generate(work, 1, "template-not-utf8.h5", "text.jsonl", "text.h5")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(work / "text.h5") as f:
        assert len(f["text"]) == 2


STORED = "'s stored "
NEEDS_TOKENIZER = "is not a tokenizer the tokenizers library reads ("


@pytest.mark.parametrize("checkpoint, args, words", [
    ("truncated", ["generate", "--prompts", "text.jsonl"],
     "text.jsonl:1: text needs the tokenizer, and truncated.h5's stored tokenizer.json "
     + NEEDS_TOKENIZER),
    ("truncated", ["generate", "--prompts", "chats.jsonl"],
     "chats.jsonl:1: a conversation needs the tokenizer, and truncated.h5's stored "
     "tokenizer.json " + NEEDS_TOKENIZER),
    ("truncated", ["generate", "--prompts", "ids.npy", "--stop", "w5"],
     "stop strings are matched in the decoded text, and truncated.h5's stored tokenizer.json "
     + NEEDS_TOKENIZER),
    ("truncated", ["score", "--data", "text.jsonl"],
     "text.jsonl:1: text needs the tokenizer, and truncated.h5's stored tokenizer.json"),
    ("truncated", ["train", "--data", "text.jsonl", "--seq-len", "2", "--steps", "1",
                   "--global-batch", "2"],
     "text.jsonl:1: text needs the tokenizer, and truncated.h5's stored tokenizer.json"),
    ("not-utf8", ["generate", "--prompts", "text.jsonl"],
     "text.jsonl:1: text needs the tokenizer, and not-utf8.h5's stored tokenizer.json is not "
     "UTF-8 text (invalid start byte at byte 0)"),
    ("template-not-utf8", ["generate", "--prompts", "chats.jsonl"],
     "chats.jsonl:1: a \"messages\" line is rendered with template-not-utf8.h5's stored "
     "chat_template.jinja, which is not UTF-8 text (invalid start byte at byte 0); convert the "
     "model again"),
    ("template-syntax", ["generate", "--prompts", "chats.jsonl"],
     "chats.jsonl:1: a \"messages\" line is rendered with template-syntax.h5's stored "
     "chat_template.jinja, which does not compile (TemplateSyntaxError: Unexpected end of "
     "template."),
    ("config-not-json", ["generate", "--prompts", "chats.jsonl"],
     "chats.jsonl:1: a \"messages\" line is rendered with config-not-json.h5's stored "
     "tokenizer_config.json, which is not valid JSON (Expecting property name"),
])
def test_a_job_that_needs_a_damaged_file_is_one_error_naming_it(work, checkpoint, args, words):
    """Text, conversations and stop strings need the tokenizer (and conversations the
    template): one line naming the checkpoint's stored file and the line that needed it."""
    command, *rest = args
    out = "needs_run" if command == "train" else "needs.h5"
    if command == "generate":
        rest += ["--max-new-tokens", "4"]
    proc = hpcpar_here([command, "--checkpoint", f"{checkpoint}.h5", *rest, "--out", out],
                       work)
    _assert_one_error(proc, words)
    if "tokenizer.json" in words:
        assert ("; convert the model again from a folder whose tokenizer.json loads, or give "
                "token ids") in proc.stderr
    assert not (work / out).exists()


# ---- invalid Unicode in a line ------------------------------------------------------------

SURROGATE = "\ud800"


@pytest.mark.parametrize("command, record, words", [
    ("generate", {"text": f"w5 {SURROGATE} w6"},
     '"text" holds invalid Unicode (a lone surrogate \\ud800 at character 3): a JSON '
     "\\ud800-\\udfff escape must be one of a pair; fix the line"),
    ("generate", {"messages": [{"role": "user", "content": "w5"},
                               {"role": "user", "content": "\udc00"}]},
     '"messages"[1]["content"] holds invalid Unicode (a lone surrogate \\udc00 at character 0)'),
    ("generate", {"messages": [{"role": "us\udfff", "content": "w5"}]},
     '"messages"[0]["role"] holds invalid Unicode'),
    ("generate", {"ids": [5, 6], "stop": ["w7", "\ud83d"]},
     '"stop"[1] holds invalid Unicode (a lone surrogate \\ud83d at character 0)'),
    ("score", {"text": f"w5 w6{SURROGATE}"}, '"text" holds invalid Unicode'),
    ("train", {"text": f"{SURROGATE}w5 w6"}, '"text" holds invalid Unicode'),
])
def test_invalid_unicode_in_a_line_is_one_error_naming_the_line(work, command, record, words):
    """A lone surrogate ("\\ud800" is valid JSON) in any string of a prompt or data line."""
    (work / "unicode.jsonl").write_text(_lines({"ids": [5, 6, 7]}, record))
    assert "\\ud" in (work / "unicode.jsonl").read_text()          # the file is plain ASCII
    option = {"generate": ["--prompts", "unicode.jsonl", "--max-new-tokens", "4"],
              "score": ["--data", "unicode.jsonl"],
              "train": ["--data", "unicode.jsonl", "--seq-len", "2", "--steps", "1",
                        "--global-batch", "2"]}[command]
    out = "unicode_run" if command == "train" else "unicode.h5"
    proc = hpcpar_here([command, "--checkpoint", "model.h5", *option, "--out", out], work)
    _assert_one_error(proc, f"unicode.jsonl:2: {words}")
    assert not (work / out).exists()


@pytest.mark.slow
def test_a_damaged_file_or_a_bad_line_is_one_error_from_one_of_two_ranks(work):
    """The cases above run on one rank, in this process; under mpiexec every rank finds the
    same and the ranks agree: one line for the job."""
    proc, _ = _hpcpar(work, 2, "generate", "--checkpoint", "truncated.h5", "--prompts",
                      "text.jsonl", "--max-new-tokens", "4", "--out", "needs2.h5")
    _assert_one_error(proc, "text.jsonl:1: text needs the tokenizer, and truncated.h5's "
                            "stored tokenizer.json")
    (work / "unicode2.jsonl").write_text(_lines({"ids": [5, 6, 7]}, {"text": f"w5 {SURROGATE}"}))
    proc, _ = _hpcpar(work, 2, "generate", "--checkpoint", "model.h5", "--prompts",
                      "unicode2.jsonl", "--max-new-tokens", "4", "--out", "unicode2.h5")
    _assert_one_error(proc, 'unicode2.jsonl:2: "text" holds invalid Unicode')
    assert not (work / "needs2.h5").exists() and not (work / "unicode2.h5").exists()


@pytest.mark.slow
def test_a_stop_string_flag_that_is_not_unicode_is_one_error(work):
    """A byte that is not UTF-8 in an argument (``--stop $'\\xff'``) arrives as a lone
    surrogate."""
    proc = _generate(work, 1, "model.h5", "ids.npy", "stop.h5", "--stop", "\udcff")
    _assert_one_error(proc, "--stop / generate.stop: stop string 0 holds invalid Unicode (a "
                            "lone surrogate \\udcff at character 0)")
    assert not (work / "stop.h5").exists()


# ---- what a template raises, and its limits -----------------------------------------------

def _render(work, template: str, messages=None):
    """Load a prompt file whose line 2 is a conversation, rendered with ``template`` stored
    in model.h5 (the tokenizer is model.h5's)."""
    ckpt = open_checkpoint(work / "model.h5")
    files = dict(ckpt.tokenizer_files(), **{"chat_template.jinja": template.encode()})
    messages = messages or [{"role": "user", "content": "w5 w6"}]
    (work / "render.jsonl").write_text(_lines({"ids": [5, 6]}, {"messages": messages}))
    return load_prompts(work / "render.jsonl", load_tokenizer(ckpt),
                        ChatTemplate.from_files(files, ckpt.path))


@pytest.mark.parametrize("template, words", [
    ("{{ range(10 ** 6) | list | length }}",
     "the chat template failed on this conversation (OverflowError: Range too big."),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
     "the chat template failed on this conversation (RecursionError: maximum recursion depth"),
    ("{% include 'other.jinja' %}", "(TypeError: no loader for this environment specified)"),
    ("{% import 'macros.jinja' as m %}{{ m.f() }}", "(TypeError: no loader for this "
                                                     "environment specified)"),
    ("{% extends 'base.jinja' %}", "(TypeError: no loader for this environment specified)"),
    ("{{ messages | length // 0 }}", "(ZeroDivisionError: integer division or modulo by zero)"),
    ("{{ 1 / 0 }}", "(ZeroDivisionError: division by zero)"),
    ("{{ 10 ** 5000 }}", "(ValueError: Exceeds the limit (4300 digits) for integer string "
                         "conversion"),
    ("{{ 9 ** (9 ** 9) }}", "the chat template computed an integer of more than 65,536 bits"),
    ("{{ (2 ** 60000) * (2 ** 60000) }}", "computed an integer of more than 65,536 bits"),
    ("{{ strftime_now(42) }}", "(TypeError: strftime() argument 1 must be str, not int)"),
    ("{{ raise_exception('roles must alternate') }}",
     "the chat template refused the conversation: roles must alternate"),
    ("{{ messages[0].nope.deeper }}", "the chat template refused the conversation: "),
    ("{{ ''.__class__.__mro__ }}", "the chat template refused the conversation: "),
    ("{{ '\\ud800' }}", "the chat template's text holds invalid Unicode (a lone surrogate "
                        "\\ud800 at character 0)"),
    ("{{ messages | sort(attribute='nope') | map(attribute=1) | sum }}",
     "the chat template"),
])
def test_whatever_a_template_raises_is_one_error_naming_the_line(work, template, words):
    with pytest.raises(HpcparError) as e:
        _render(work, template)
    message = str(e.value)
    assert message.startswith(f"{work / 'render.jsonl'}:2: "), message
    assert words in message, message
    assert "\n" not in message and len(message) < 400


ORDINARY = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role | upper }}: "
    "{{ m.content | trim | replace('w', 'W') | center(12) }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}",
    "{% set ns = namespace(n=0, s='') %}{% for m in messages if m.role == 'user' %}"
    "{% set ns.n = ns.n + 1 %}{% set ns.s = ns.s ~ m.content ~ '|' %}{% endfor %}"
    "{{ ns.n }} {{ ns.s }} {{ 'id 123456789 {}'.format(ns.n) }} {{ 'id 987654321 %05d' % 7 }}",
    "{% macro show(m) %}[{{ m.role }}]{{ caller() if caller else '' }}{% endmacro %}"
    "{% for m in messages %}{% call show(m) %}{{ m.content.split() | join('+') }}{% endcall %}"
    "{% endfor %}{{ messages | map(attribute='role') | unique | list | length }}",
    "{{ messages | tojson(indent=2) }}{{ {'tools': [1, 2]} | tojson }}{{ '%s-%s' | format(1, 2) }}"
    "{{ 2 ** 10 }} {{ 7 * 6 }} {{ [1] * 3 }} {{ 'ab' * 3 }} {{ range(5) | batch(2) | list }}",
    "{% for m in messages recursive %}{{ loop.depth }}{% if loop.depth < 3 %}"
    "{{ loop([m]) }}{% endif %}{% endfor %}{% set t %}{{ 'x' * 3 }}{% endset %}{{ t }}",
]


@pytest.mark.parametrize("template", ORDINARY)
def test_ordinary_templates_render_as_jinjas_own_sandbox_renders_them(work, template):
    """The limits watch a template; they change nothing it renders."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": " w3 "},
                {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5 w6"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                              indent=indent)
    want = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    assert ChatTemplate(template, {}).render(messages, "here") == want


MB_LIMIT = "(HPCPAR_TEMPLATE_MB=4); raise it (0: no limit) if the conversation is meant to be " \
           "that long"


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10 ** 9 }}", "{{ ['w5'] * 10 ** 9 }}", "{{ ['w5' * 1000] * 10 ** 4 }}",
    "{{ 'x' | center(10 ** 9) }}", "{{ 'x'.ljust(10 ** 9) }}", "{{ 'x'.zfill(10 ** 9) }}",
    "{{ ('x' * 3000000).replace('', 'yy') }}", "{{ 'ab' | replace('', 'x' * 3000000) }}",
    "{{ '%0999999999d' % 1 }}", "{{ '%*d' % (10 ** 9, 1) }}", "{{ '{:>999999999}'.format(1) }}",
    "{{ '{0:{1}}'.format(1, 10 ** 9) }}", "{{ '%09999999999d' | format(1) }}",
    "{{ ('x' * 1000000, 'y' * 1000000, 'z' * 3000000) | join }}",
    "{{ ('x', 'y', 'z') | join('-' * 3000000) }}", "{{ ('x\n' * 100000) | indent(100) }}",
    "{{ ('a ' * 100000) | wordwrap(1, wrapstring='x' * 100) }}",
    "{{ ('\t' * 3000).expandtabs(10 ** 6) }}", "{{ lipsum(10 ** 7) }}",
    "{{ 'abc'.translate({97: 'y' * 4000000}) }}", "{{ messages | tojson(indent=10 ** 9) }}",
    "{{ range(10) | batch(10 ** 9, 0) | list }}", "{{ range(10) | slice(10 ** 9) | list }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s=['ab']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
])
def test_a_value_past_the_size_limit_is_refused_before_it_is_built(work, template):
    """Operations that could make a huge value in one step are checked before they run
    (the test would run out of memory otherwise), the others after."""
    start = time.monotonic()
    with pytest.raises(HpcparError, match=re.escape(
            f"render.jsonl:2: the chat template built a value of more than 4 MB {MB_LIMIT}")):
        _render(work, template)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{{ 'w5 ' * 100 }}{% endfor %}",
    "{% macro m() %}{% for i in range(100000) %}{{ 'w5 ' * 100 }}{% endfor %}{% endmacro %}"
    "{{ m() }}",
    "{% set text %}{% for i in range(100000) %}{{ 'w5 ' * 100 }}{% endfor %}{% endset %}"
    "{{ text }}",
])
def test_a_rendering_past_the_size_limit_is_one_error(work, template):
    with pytest.raises(HpcparError, match=re.escape(
            f"render.jsonl:2: the chat template rendered a text of more than 4 MB {MB_LIMIT}")):
        _render(work, template)


@pytest.mark.parametrize("template", [
    LOOPS,
    "{% for i in range(100000) %}{% for c in 'x' * 4000000 %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    "{{ f(60) }}",
    "{% for m in messages recursive %}{% if loop.depth < 60 %}{{ loop(messages * 2) }}"
    "{% endif %}{% endfor %}",
])
def test_a_rendering_past_the_time_limit_is_one_error(work, template, monkeypatch):
    monkeypatch.setenv("HPCPAR_TEMPLATE_SECONDS", "0.5")
    start = time.monotonic()
    with pytest.raises(HpcparError, match=re.escape(
            "render.jsonl:2: rendering the chat template took more than 0.5 s "
            "(HPCPAR_TEMPLATE_SECONDS=0.5); raise it (0: no limit) if the template is meant "
            "to take that long")):
        _render(work, template)
    assert time.monotonic() - start < 5


def test_the_limits_are_settable_and_0_turns_them_off(work, monkeypatch):
    slow = "{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}w5"
    long = "{{ 'w5 ' * 1000 }}"
    monkeypatch.setenv("HPCPAR_TEMPLATE_SECONDS", "0.001")
    with pytest.raises(HpcparError, match="took more than 0.001 s"):
        _render(work, slow)
    monkeypatch.setenv("HPCPAR_TEMPLATE_SECONDS", "0")
    assert _render(work, slow).ids[1].tolist() == [7 + 5]             # "w5"
    monkeypatch.setenv("HPCPAR_TEMPLATE_MB", "0.001")
    with pytest.raises(HpcparError, match=r"more than 0.001 MB \(HPCPAR_TEMPLATE_MB=0.001\)"):
        _render(work, long)
    monkeypatch.setenv("HPCPAR_TEMPLATE_MB", "0")
    assert len(_render(work, long).ids[1]) == 1000
    for value in ("-1", "nan", "five"):
        monkeypatch.setenv("HPCPAR_TEMPLATE_SECONDS", value)
        with pytest.raises(HpcparError, match=f"HPCPAR_TEMPLATE_SECONDS='{value}': must be a "
                                              "number >= 0"):
            _render(work, long)


@pytest.mark.slow
def test_a_template_that_never_ends_stops_at_start_up_with_one_line(work):
    """Under mpiexec: the stored template's nested loops stop at the time limit, on every
    rank, with one line and status 2; a rendering past the size limit too."""
    start = time.monotonic()
    proc = _generate(work, 2, "loops.h5", "chats.jsonl", "loops.h5.out.h5",
                     env={"HPCPAR_TEMPLATE_SECONDS": "1"})
    _assert_one_error(proc, "chats.jsonl:1: rendering the chat template took more than 1 s "
                            "(HPCPAR_TEMPLATE_SECONDS=1); raise it (0: no limit)")
    assert time.monotonic() - start < 60
    proc = _generate(work, 2, "big.h5", "chats.jsonl", "big.h5.out.h5")
    _assert_one_error(proc, f"chats.jsonl:1: the chat template rendered a text of more than "
                            f"4 MB {MB_LIMIT}")
    proc = _generate(work, 1, "model.h5", "chats.jsonl", "env.h5",
                     env={"HPCPAR_TEMPLATE_MB": "-2"})
    _assert_one_error(proc, "HPCPAR_TEMPLATE_MB='-2': must be a number >= 0")
    assert not any((work / name).exists() for name in ("loops.h5.out.h5", "big.h5.out.h5",
                                                       "env.h5"))


def test_the_generation_guide_gives_the_limits_and_their_defaults():
    readme = (REPO / "docs" / "guides" / "generation.md").read_text()
    seconds = settings.ENVIRONMENT["HPCPAR_TEMPLATE_SECONDS"][1]
    mb = settings.ENVIRONMENT["HPCPAR_TEMPLATE_MB"][1]
    assert f"`HPCPAR_TEMPLATE_SECONDS` (default {seconds:g} s)" in readme
    assert f"`HPCPAR_TEMPLATE_MB` (default {mb:g} MB" in readme


# ---- convert ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, data, words", [
    ("tokenizer.json", b'{"version": "1.0", "model": ', "tokenizer.json is not a tokenizer the "
                                                       "tokenizers library reads ("),
    ("tokenizer.json", b"\xff\xfe", "tokenizer.json is not UTF-8 text (invalid start byte at "
                                    "byte 0)"),
    ("chat_template.jinja", b"\xc3(", "chat_template.jinja is not UTF-8 text (invalid "
                                      "continuation byte at byte 0)"),
    ("chat_template.jinja", b"{% if messages %}", "chat_template.jinja does not compile "
                                                  "(TemplateSyntaxError: "),
    ("tokenizer_config.json", b"{nope", "tokenizer_config.json is not valid JSON (Expecting "),
    ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json holds a JSON list, not an "
                                         "object"),
])
def test_convert_refuses_a_damaged_tokenizer_file_naming_it(work, tmp_path, name, data, words):
    hf = tmp_path / "hf"
    shutil.copytree(work / "hf", hf)
    (hf / name).write_bytes(data)
    with pytest.raises(HpcparError) as e:
        convert(hf, tmp_path / "out.h5")
    assert str(e.value).startswith(f"{hf / name}"), str(e.value)
    assert words in str(e.value) and "move it out of the folder to convert without it" in str(
        e.value)
    assert list(tmp_path.iterdir()) == [hf]
    (hf / name).unlink()                            # without it, the model converts
    convert(hf, tmp_path / "out.h5")


@pytest.mark.slow
def test_convert_of_a_damaged_tokenizer_is_one_line_and_status_2(work, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(work / "hf", hf)
    (hf / "tokenizer.json").write_bytes(b"[")
    proc, _ = _hpcpar(tmp_path, 1, "convert", str(hf), "out.h5")
    _assert_one_error(proc, f"{hf / 'tokenizer.json'} is not a tokenizer the tokenizers "
                            "library reads")
    assert not (tmp_path / "out.h5").exists()
