"""The checkpoint's tokenizer (``tokenizer.json``, kept at conversion), parsed the first time
a job needs it.

Text prompts and data, conversations and stop strings need it; token ids do not, so a
checkpoint whose stored tokenizer is damaged still generates, scores and trains on ids (the
output then holds no text). A job that needs it gets one error naming the stored file and
the line that asked for it.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cached_property
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
        self._bytes: dict[int, bytes] = {}         # token id -> its bytes, once looked up

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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (OpenAI's log-probs' ``bytes``): a
        byte-level BPE token's own bytes, a byte-fallback token's byte (``<0xE2>``), a
        SentencePiece piece with its ``▁`` a space, else (special tokens, word-level
        vocabularies) its text's UTF-8. A character split over tokens is their bytes joined,
        where each piece's text alone is U+FFFD."""
        if token_id not in self._bytes:
            self._bytes[token_id] = self._find_bytes(token_id)
        return self._bytes[token_id]

    def _find_bytes(self, token_id: int) -> bytes:
        tokenizer = self.require()
        piece = tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._added_ids:
            return tokenizer.decode([token_id], skip_special_tokens=False).encode()
        decoders = self._decoders
        if "ByteLevel" in decoders and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if "ByteFallback" in decoders and (byte := BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte[1], 16)])
        if "Metaspace" in decoders or "Replace ▁" in decoders:
            return piece.replace("▁", " ").encode()
        return tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @cached_property
    def _decoders(self) -> set[str]:
        """The kinds of the tokenizer's decoder and of those it chains ("Replace ▁" for a
        Replace of SentencePiece's word mark)."""
        found, todo = set(), [json.loads(self.require().to_str()).get("decoder")]
        while todo:
            step = todo.pop()
            if isinstance(step, dict):
                kind = step.get("type")
                if kind == "Replace" and step.get("pattern", {}).get("String") == "▁":
                    kind = "Replace ▁"
                found.add(kind)
                todo.extend(step.get("decoders") or [])
        return found

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self.require().get_added_tokens_decoder())


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, each byte's printable stand-in -> the byte: printable
    Latin-1 bytes stand for themselves, the others for 256 + their rank among them."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_LEVEL = _byte_level_alphabet()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")       # a byte-fallback token

