"""Conversations as prompts: a ``{"messages": [{"role": ..., "content": ...}, ...]}`` line is
rendered with the checkpoint's own chat template, as transformers' ``apply_chat_template``
renders it (``add_generation_prompt=True``), then tokenized without adding special tokens
(the template writes them).

The template is kept at conversion: ``chat_template.jinja``, else the ``chat_template`` of
``tokenizer_config.json`` (a string, or named templates of which "default" is used). It is
untrusted code from a model hub, so it runs in jinja2's immutable sandbox, bounded in time and
size (``chat_sandbox.py``: ``HPCPAR_TEMPLATE_SECONDS``, ``HPCPAR_TEMPLATE_MB``), with the helpers
transformers gives templates (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text) and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).

For training, a conversation is rendered whole (no generation prompt) and the text of the
assistant's turns found, as transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` finds it: the spans a template marks with
``{% generation %} ... {% endgeneration %}`` (``render_spans``).

Only conversations need the template: a stored one that is damaged (not UTF-8, not JSON, not
compiling) is found when a ``messages`` line first asks for it, and reported naming that line
and the stored file; token ids and text run without it. Whatever rendering raises is one
error naming the line.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ..parallel.errors import HpcparError
from .render_limits import template_limits

if TYPE_CHECKING:
    from .chat_sandbox import LimitedSandbox

# a template that marks the assistant's text for training, as transformers looks for it
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")

class ChatError(HpcparError):
    pass


def _token_text(value) -> str | None:
    """A special token as tokenizer configs write it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate, as JSON's ``"\\ud800"`` makes),
    or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}"
    return None


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message as one printable line."""
    try:
        text = str(e)
    except Exception:                      # noqa: BLE001 (a message that cannot be shown)
        text = ""
    text = (text.strip().splitlines() or [type(e).__name__])[0]
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ChatTemplate:
    """A checkpoint's chat template and the special tokens it may print, compiled the first
    time a conversation needs it. ``origin`` names the stored file it came from; ``problem``,
    when set, says why it cannot be used (found when the files were read)."""

    def __init__(self, source: str | None, special: dict[str, str],
                 origin: str = "the checkpoint's chat template", problem: str | None = None):
        self.source, self.special, self.origin, self.problem = source, special, origin, problem
        self._env: LimitedSandbox | None = None
        self._template = None

    @classmethod
    def from_files(cls, files: dict[str, bytes], checkpoint: str | Path | None = None,
                   folder: str | Path | None = None) -> "ChatTemplate | None":
        """The template among a checkpoint's tokenizer files (or a Hugging Face ``folder``'s),
        or None when it has none; a damaged file makes a template whose ``problem`` says so
        (never an error here: jobs without conversations do not need it)."""
        def file(name: str) -> str:
            return (str(Path(folder) / name) if folder else
                    f"{checkpoint}'s stored {name}" if checkpoint else f"the checkpoint's {name}")
        config, problems = {}, {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            if name in files:
                try:
                    loaded = json.loads(files[name])
                except ValueError as e:            # UnicodeDecodeError is one too
                    problems[name] = f"is not valid JSON ({one_line(e)})"
                    continue
                if isinstance(loaded, dict):
                    config |= loaded
                else:
                    problems[name] = f"holds a JSON {type(loaded).__name__}, not an object"
        if "chat_template.jinja" in files:
            origin = file("chat_template.jinja")
            try:
                source = files["chat_template.jinja"].decode("utf-8")
            except UnicodeDecodeError as e:
                return cls(None, {}, origin, f"is not UTF-8 text ({e.reason} at byte "
                                             f"{e.start})")
        else:
            origin = f"the chat_template of {file('tokenizer_config.json')}"
            if "tokenizer_config.json" in problems:
                return cls(None, {}, file("tokenizer_config.json"),
                           problems["tokenizer_config.json"])
            source = config.get("chat_template")
            if isinstance(source, list):                 # named templates
                source = next((t.get("template") for t in source
                               if isinstance(t, dict) and t.get("name") == "default"), None)
            if source is not None and not isinstance(source, str):
                return cls(None, {}, origin, f"is a JSON {type(source).__name__}, not a "
                                             "template's text")
        if not source:
            return None
        if problems:                                     # the special tokens are unknown
            name, why = next(iter(problems.items()))
            return cls(None, {}, file(name), why)
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        return cls(source, special, origin)

    def check(self) -> str | None:
        """Why the template cannot be used (compiling it, the first time), or None."""
        try:
            self._compiled("")
        except ChatError:
            return self.problem
        return None

    def _compiled(self, where: str):
        if self._template is None and self.problem is None:
            # jinja2 loads here, with the first template compiled: not in every rank's start
            from .chat_sandbox import LimitedSandbox
            self._env = env = LimitedSandbox()
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.limit(*template_limits())
            env.add_extension(_generation_tracker())
            try:
                self._template = env.compile_source(self.source)
            except Exception as e:                   # noqa: BLE001 (syntax, recursion, ...)
                self.problem = f"does not compile ({type(e).__name__}: {one_line(e)})"
        if self.problem is not None:
            raise ChatError(f"{where}: a \"messages\" line is rendered with {self.origin}, "
                            f"which {self.problem}; convert the model again from a folder "
                            "with a good one, or give the prompt as \"text\" or \"ids\"")
        return self._template

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}``."""
        return bool(self.source and GENERATION_MARKER.search(self.source))

    def render(self, messages: list[dict], where: str,
               add_generation_prompt: bool = True) -> str:
        """The conversation as the prompt text, a generation prompt opened after it (unless
        ``add_generation_prompt`` is false). Whatever the template raises, and a rendering past
        the time or size limit, is one error naming ``where``."""
        return self.render_spans(messages, where, add_generation_prompt)[0]

    def render_spans(self, messages: list[dict], where: str,
                     add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the [start, end) character spans of it that the
        template's ``{% generation %}`` blocks wrote (none if it has no such block), as
        transformers' ``render_jinja_template(return_assistant_tokens_mask=True)``."""
        import jinja2

        from .chat_sandbox import RenderLimit
        template = self._compiled(where)
        env = self._env
        env.limit(*template_limits())
        pieces, size, spans = [], 0, []
        env.generation_tracking = (pieces, spans)
        stream = template.generate(messages=messages,
                                   add_generation_prompt=add_generation_prompt, **self.special)
        try:
            for piece in stream:
                size += len(piece)
                env.too_large(size, "rendered a text")
                env.tick()
                pieces.append(piece)
        except RenderLimit as e:
            raise ChatError(f"{where}: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"{where}: the chat template refused the conversation: "
                            f"{one_line(e)}") from None
        except Exception as e:                       # noqa: BLE001 (any error of the template)
            raise ChatError(f"{where}: the chat template failed on this conversation "
                            f"({type(e).__name__}: {one_line(e)})") from None
        finally:
            stream.close()
            env.generation_tracking = None
        text = "".join(pieces)
        bad = unicode_problem(text)
        if bad:
            raise ChatError(f"{where}: the chat template's text holds invalid Unicode ({bad})")
        return text, spans


def _generation_tracker():
    """The jinja2 extension of ``{% generation %} ... {% endgeneration %}``: the block's text
    is written as it is, and while a rendering tracks (``environment.generation_tracking``
    holds the pieces written so far and a list of spans) its [start, end) characters in the
    whole text are noted, as transformers' ``AssistantTracker`` notes them."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(generation_tracking=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_generation", []), [], [],
                                   body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context, caller):
            text = caller()
            tracking = self.environment.generation_tracking
            if tracking is not None:
                pieces, spans = tracking
                start = sum(len(p) for p in pieces)
                spans.append((start, start + len(text)))
            return text

    return GenerationTracker


def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def check_messages(messages, where: str) -> list[dict]:
    """A conversation: a non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}: \"messages\" must be a non-empty list of "
                        "{\"role\": ..., \"content\": ...} objects")
    for k, m in enumerate(messages):
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            raise ChatError(f"{where}: message {k} must be an object with string \"role\" and "
                            f"\"content\", got {json.dumps(m)[:80]}")
    return messages
