"""Fine-tuning data: a ``.jsonl`` whose lines are each one sample with the loss on some of its
tokens only (docs/guides/training.md, "Chat data").

A line is one of

- ``{"messages": [...]}``: a conversation rendered whole with the checkpoint's chat template
  (no generation prompt) and tokenized without adding special tokens, as transformers'
  ``apply_chat_template`` does; the loss on the assistant's tokens: those overlapping the
  text the template's ``{% generation %}`` blocks write, where it has them (transformers'
  ``return_assistant_tokens_mask=True``), else the text each assistant message adds: from the
  end of the messages before it, rendered with the generation prompt, to the end of the
  messages up to it;
- ``{"prompt": ..., "completion": ...}`` as TRL takes them: two strings (tokenized as the
  text ``prompt + completion`` with the tokenizer's special tokens, EOS added when the
  completion does not end with it; the loss on the tokens after the prompt's own), or two
  lists of messages (the prompt rendered with the generation prompt; the loss on the tokens
  of the text the completion adds);
- ``{"ids": [...], "labels": [...]}`` as transformers takes them: labels aligned with the
  ids (the model shifts them: position t predicts ``labels[t + 1]``), -100 where no loss.

Each row is one sample of at most ``seq_len + 1`` tokens (``seq_len`` inputs and the label of
the last), padded; a longer one is refused or cut (``long_rows``), and a row with no token
left to learn is counted and skipped. Every problem is one line naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...models.chat import ChatError, check_messages, one_line
from ...models.config import ModelConfig
from ...models.tokenizer import StoredTokenizer
from ...parallel.errors import HpcparError

IGNORE = -100                                 # transformers' ignore_index
LONG_ROWS = ("refuse", "cut")
FORMS = ("messages", "prompt", "completion", "labels")   # a line of one of these: fine-tuning


class FineTuningError(HpcparError):
    pass


@dataclass
class FineTuningRows:
    """The rows as samples: ``samples`` (rows, L + 1) ids left-padded with -1, ``labels`` the
    same shape, aligned with them (-1: no loss, padding too); and what reading them found."""

    samples: np.ndarray
    labels: np.ndarray
    cut: int                         # rows longer than L + 1 tokens, cut
    skipped: int                     # rows with nothing to learn, left out

    @property
    def loss_tokens(self) -> int:
        return int((self.labels[:, 1:] >= 0).sum())

    def describe(self, source: str) -> str:
        rows, width = self.samples.shape
        text = (f"{source}: {rows:,} rows of at most {width:,} tokens, {self.loss_tokens:,} "
                f"tokens carrying the loss")
        if self.cut:
            text += f"; {_rows(self.cut)} cut to {width:,} tokens"
        if self.skipped:
            text += f"; {_rows(self.skipped)} with nothing to learn skipped"
        return text


def _rows(n: int) -> str:
    return f"{n:,} row" + ("" if n == 1 else "s")


def is_fine_tuning(records: list[tuple[int, object]]) -> bool:
    """Whether a ``.jsonl``'s lines are fine-tuning rows (else documents to pack)."""
    return any(isinstance(r, dict) and any(k in r for k in FORMS) for _, r in records)


def fine_tuning_rows(path: Path, records: list[tuple[int, object]], cfg: ModelConfig,
                     seq_len: int | None, long_rows: str, tokenizer, chat) -> FineTuningRows:
    """Every line's ids and labels, checked, as samples of ``seq_len + 1`` tokens (without
    ``seq_len``: the longest row's length)."""
    rows = []
    for n, record in records:
        where = f"{path}:{n}"
        ids, labels = line_row(record, cfg, tokenizer, chat, where)
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise FineTuningError(f"{where}: token id {int(bad[0])} is outside the model's "
                                  f"vocabulary [0, {cfg.vocab_size})")
        rows.append((where, ids, labels))
    width = seq_len + 1 if seq_len else max(max(len(ids) for _, ids, _ in rows), 2)
    cut = skipped = 0
    kept = []
    for where, ids, labels in rows:
        if len(ids) > width:
            if long_rows != "cut":
                raise FineTuningError(
                    f"{where}: the row has {len(ids):,} tokens, more than the {width:,} a "
                    f"sample holds (--seq-len {width - 1} inputs and the label of the last); "
                    "raise --seq-len, or cut such rows with --long-rows cut")
            ids, labels, cut = ids[:width], labels[:width], cut + 1
        if not (labels[1:] != IGNORE).any():      # the first token's label predicts nothing
            skipped += 1
            continue
        kept.append((ids, labels))
    if not kept:
        raise FineTuningError(f"{path}: no row has a token to learn ({skipped} rows, every "
                              "label after the first token masked)")
    samples = np.full((len(kept), width), -1, dtype=np.int64)
    targets = np.full((len(kept), width), -1, dtype=np.int64)
    for r, (ids, labels) in enumerate(kept):          # left padding (see data.make_batches)
        samples[r, width - len(ids):] = ids
        targets[r, width - len(ids):] = np.where(labels == IGNORE, -1, labels)
    return FineTuningRows(samples, targets, cut, skipped)


def line_row(record, cfg: ModelConfig, tokenizer, chat, where: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """One line's (ids, labels), labels aligned with ids and -100 where no loss."""
    if not isinstance(record, dict):
        record = {None: record}                  # no form: the message names its type
    forms = [k for k in ("messages", "prompt", "labels") if k in record]
    if len(forms) != 1:
        got = ("is an empty object" if not record else
               f"is a JSON {type(record[None]).__name__}" if None in record else
               f"has keys {', '.join(json.dumps(k) for k in record)}")
        raise FineTuningError(f"{where}: a fine-tuning line holds \"messages\", or \"prompt\" "
                              f"and \"completion\", or \"ids\" and \"labels\" (one of them); "
                              f"this one {got}")
    for key in ("tools", "documents"):
        if key in record:
            raise FineTuningError(f"{where}: \"{key}\" for the chat template is not supported "
                                  "in training data; give the rendered ids and labels")
    if forms == ["labels"]:
        return labelled_row(record, cfg.vocab_size, where)
    if forms == ["prompt"]:
        return prompt_completion_row(record, cfg, tokenizer, chat, where)
    if "completion" in record:
        raise FineTuningError(f"{where}: \"completion\" goes with \"prompt\", not with "
                              "\"messages\"")
    return conversation_row(record["messages"], tokenizer, chat, where)


def labelled_row(record: dict, vocab_size: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``{"ids", "labels"}``: two lists of integers of one length, labels in the vocabulary
    or -100."""
    lists = {}
    for key in ("ids", "labels"):
        value = record.get(key)
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                  and -2 ** 63 <= t < 2 ** 63 for t in value):
            raise FineTuningError(f"{where}: \"{key}\" must be a list of integers"
                                  + ("" if key in record else f" (the line has no \"{key}\")"))
        lists[key] = np.asarray(value, dtype=np.int64)
    ids, labels = lists["ids"], lists["labels"]
    if len(labels) != len(ids):
        raise FineTuningError(f"{where}: {len(labels)} labels for {len(ids)} ids; labels are "
                              "aligned with the ids, one each (-100: no loss)")
    bad = labels[(labels != IGNORE) & ((labels < 0) | (labels >= vocab_size))]
    if bad.size:
        raise FineTuningError(f"{where}: label {int(bad[0])} is neither a token id in [0, "
                              f"{vocab_size}) nor -100 (no loss)")
    return ids, labels


def conversation_row(messages, tokenizer, chat, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's ids, the loss on the assistant's tokens."""
    messages = check_messages(messages, where)
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(sorted({m["role"] for m in messages}))
        raise FineTuningError(f"{where}: no message has the role \"assistant\" (the roles are "
                              f"{roles}): the loss is on the assistant's turns")
    chat = _template(chat, where)
    if chat.marks_generation:
        text, spans = chat.render_spans(messages, where)
        if not spans:
            raise FineTuningError(f"{where}: the chat template marks no text of this "
                                  "conversation with {% generation %}, so no token is the "
                                  "assistant's; fix the template or give \"ids\" and \"labels\"")
    else:
        text = chat.render(messages, where, add_generation_prompt=False)
        spans = [_added_span(chat, messages, k, text, where)
                 for k, m in enumerate(messages) if m["role"] == "assistant"]
    return _masked(tokenizer, text, spans, where, False)


def _added_span(chat, messages: list[dict], k: int, text: str, where: str) -> tuple[int, int]:
    """The characters assistant message k adds to the whole conversation's ``text``: from the
    end of the messages before it rendered with the generation prompt to the end of the
    messages up to it."""
    before = chat.render(messages[:k], where, add_generation_prompt=True)
    through = chat.render(messages[:k + 1], where, add_generation_prompt=False)
    if not text.startswith(before) or not text.startswith(through):
        part = "before it, with the generation prompt," if not text.startswith(before) else \
            "up to it"
        raise FineTuningError(f"{where}: message {k} (assistant): the chat template renders the "
                              f"messages {part} as a text the whole conversation does not begin "
                              "with, so the assistant's part is not found; mark it with "
                              "{% generation %} in the template, or give \"ids\" and "
                              "\"labels\"")
    if len(through) <= len(before):
        raise FineTuningError(f"{where}: message {k} (assistant): the chat template renders "
                              "nothing of the assistant's message; a template that renders "
                              "assistant turns is needed, or give \"ids\" and \"labels\"")
    return len(before), len(through)


def prompt_completion_row(record: dict, cfg: ModelConfig, tokenizer, chat,
                          where: str) -> tuple[np.ndarray, np.ndarray]:
    """``{"prompt", "completion"}``: two strings, or two lists of messages."""
    prompt, completion = record["prompt"], record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        tok = _tokenizer(tokenizer, where)
        first = _encode(tok, prompt, True, where).ids
        whole = list(_encode(tok, prompt + completion, True, where).ids)
        eos = list(cfg.eos_token_id)
        if eos and (not whole or whole[-1] not in eos):
            whole.append(eos[0])                 # TRL adds EOS to a completion without one
        ids = np.asarray(whole, dtype=np.int64)
        labels = ids.copy()
        labels[:len(first)] = IGNORE
        return ids, labels
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = check_messages(prompt, f"{where}: \"prompt\"")
        completion = check_messages(completion, f"{where}: \"completion\"")
        chat = _template(chat, where)
        head = chat.render(prompt, where, add_generation_prompt=True)
        text = chat.render(prompt + completion, where, add_generation_prompt=False)
        if not text.startswith(head) or len(text) == len(head):
            raise FineTuningError(f"{where}: the chat template renders the prompt, with the "
                                  "generation prompt, as a text the prompt and completion "
                                  "together do not begin with (or end with), so the completion "
                                  "is not found; give \"ids\" and \"labels\"")
        return _masked(tokenizer, text, [(len(head), len(text))], where, False)
    if completion is None:
        raise FineTuningError(f"{where}: \"prompt\" needs its \"completion\"")
    raise FineTuningError(f"{where}: \"prompt\" and \"completion\" must be two strings or two "
                          "lists of messages, got a "
                          f"{type(prompt).__name__} and a {type(completion).__name__}")


def _masked(tokenizer, text: str, spans: list[tuple[int, int]], where: str,
            special: bool) -> tuple[np.ndarray, np.ndarray]:
    """``text``'s ids and labels: the loss on every token whose characters overlap a span
    (spans in order), as transformers' assistant mask."""
    enc = _encode(_tokenizer(tokenizer, where), text, special, where)
    ids = np.asarray(enc.ids, dtype=np.int64)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)    # (tokens, 2)
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    k = np.searchsorted(ends, offsets[:, 0], side="right")   # the first span ending after it
    inside = k < len(spans)
    inside[inside] = offsets[inside, 1] > starts[k[inside]]
    return ids, np.where(inside, ids, IGNORE)


def _template(chat, where: str):
    if chat is None:
        raise ChatError(f"{where}: a conversation is rendered with the checkpoint's chat "
                        "template, and this checkpoint has none; convert from a Hugging Face "
                        "folder whose tokenizer_config.json or chat_template.jinja holds one, "
                        "or give \"ids\" and \"labels\"")
    return chat


def _tokenizer(tokenizer, where: str):
    if tokenizer is None:
        raise FineTuningError(f"{where}: text and conversations need the tokenizer, and this "
                              "checkpoint has none; convert the model from a Hugging Face "
                              "folder that holds tokenizer.json, or give \"ids\" and \"labels\"")
    if isinstance(tokenizer, StoredTokenizer):
        return tokenizer.require(f"{where}: text needs the tokenizer, and ")
    return tokenizer


def _encode(tokenizer, text: str, special: bool, where: str):
    """The tokenizer's encoding of ``text`` (ids and character offsets)."""
    try:
        return tokenizer.encode(text, add_special_tokens=special)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:                        # noqa: BLE001 (tokenizers' panics too)
        raise FineTuningError(f"{where}: the tokenizer failed on the line's text "
                              f"({type(e).__name__}: {one_line(e)})") from None
