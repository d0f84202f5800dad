"""The checkpoint's tokenizer (``tokenizer.json``, kept at conversion), parsed the first time
a job needs it.

Text prompts and data, conversations and stop strings need it; token ids do not, so a
checkpoint whose stored tokenizer is damaged still generates, scores and trains on ids (the
output then holds no text). A job that needs it gets one error naming the stored file and
the line that asked for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..parallel.errors import HpcparError
from .chat import one_line


class TokenizerError(HpcparError):
    pass


class StoredTokenizer:
    """A ``tokenizers.Tokenizer`` read from ``data`` (the stored ``tokenizer.json``) on first
    use; ``encode`` and ``decode`` are the tokenizer's."""

    def __init__(self, data: bytes, checkpoint: str | Path | None = None):
        self._data = data
        self.origin = (f"{checkpoint}'s stored tokenizer.json" if checkpoint
                       else "the checkpoint's tokenizer.json")
        self._tokenizer = None
        self._problem: str | None = None
        self._noted = False

    def problem(self) -> str | None:
        """Why the tokenizer cannot be used, or None (parsing it, the first time)."""
        if self._tokenizer is None and self._problem is None:
            from tokenizers import Tokenizer
            try:
                self._data.decode("utf-8")
            except UnicodeDecodeError as e:
                self._problem = f"is not UTF-8 text ({e.reason} at byte {e.start})"
                return self._problem
            try:
                self._tokenizer = Tokenizer.from_buffer(self._data)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:            # noqa: BLE001 (tokenizers' panics too)
                why = one_line(e).removeprefix("Cannot instantiate Tokenizer from buffer: ")
                self._problem = f"is not a tokenizer the tokenizers library reads ({why})"
        return self._problem

    def require(self, need: str = "") -> object:
        """The parsed tokenizer; a ``TokenizerError`` (``need``: who asks, and why, e.g.
        ``"prompts.jsonl:3: text needs the tokenizer, and "``) when it cannot be read."""
        why = self.problem()
        if why is not None:
            need = need or "this job needs the tokenizer, and "
            raise TokenizerError(f"{need}{self.origin} {why}; convert the model again from a "
                                 "folder whose tokenizer.json loads, or give token ids")
        return self._tokenizer

    def usable(self) -> bool:
        """Whether it can be used; the first time it cannot, one note says the output holds
        no text (for jobs that only decode their output)."""
        why = self.problem()
        if why is not None and not self._noted:
            self._noted = True
            print(f"hpcpar: note: {self.origin} {why}; the output holds token ids without "
                  "their text", file=sys.stderr, flush=True)
        return why is None

    def encode(self, text: str, add_special_tokens: bool = True):
        return self.require().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.require().decode(ids, skip_special_tokens=skip_special_tokens)

