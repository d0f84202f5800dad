"""Conversations as prompts: a ``{"messages": [{"role": ..., "content": ...}, ...]}`` line is
rendered with the checkpoint's own chat template, as transformers' ``apply_chat_template``
renders it (``add_generation_prompt=True``), then tokenized without adding special tokens
(the template writes them).

The template is kept at conversion: ``chat_template.jinja``, else the ``chat_template`` of
``tokenizer_config.json`` (a string, or named templates of which "default" is used). It is
untrusted code from a model hub, so it runs in jinja2's immutable sandbox, with the helpers
transformers gives templates (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text) and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from datetime import datetime

from ..errors import HpcparError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")


class ChatError(HpcparError):
    pass


def _token_text(value) -> str | None:
    """A special token as tokenizer configs write it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it may print."""

    def __init__(self, source: str, special: dict[str, str]):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the checkpoint's chat template does not compile ({e})") from None
        self.special = special

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> "ChatTemplate | None":
        """The template among a checkpoint's tokenizer files, or None when it has none."""
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            if name in files:
                try:
                    loaded = json.loads(files[name])
                except ValueError:
                    raise ChatError(f"the checkpoint's {name} is not valid JSON") from None
                if isinstance(loaded, dict):
                    config |= loaded
        source = files.get("chat_template.jinja", b"").decode("utf-8") or config.get(
            "chat_template")
        if isinstance(source, list):                 # named templates
            source = next((t.get("template") for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(source, str) or not source:
            return None
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        return cls(source, special)

    def render(self, messages: list[dict], where: str) -> str:
        """The conversation as the prompt text, a generation prompt opened after it."""
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        **self.special)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"{where}: the chat template refused the conversation: {e}") from None


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
