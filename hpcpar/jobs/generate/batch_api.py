"""OpenAI Batch API files in and out, as vLLM's ``run_batch`` takes and writes them.

In: a prompts ``.jsonl`` whose lines are Batch API requests,

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_completion_tokens": 64, ...}}

(``/v1/completions`` takes ``"prompt"``, a string or token ids). Each request's body becomes
a prompt line (``prompts.prompt_line``) and is checked as one; a request hpcpar cannot serve
(another url or method, a field it does not support, a bad value, a prompt too long for the
model) becomes that request's ``error`` record, and the others run. A file whose lines are
not all requests, lack a ``custom_id`` or repeat one is refused as a whole, as OpenAI does.

Out (``--out NAME.jsonl``): one line per request, in input order, written as the requests
finish (the JSON lines' streaming and resume), each
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``
with a ``chat.completion`` or ``text_completion`` body (its n ``choices``, their text or
message, finish reason and log-probs, and ``usage``), or ``"response": null`` and
``"error": {"code", "message"}`` for a request that was not served.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...parallel.errors import HpcparError
from ..inputs.prompts import PromptError, Prompts, prompt_line, read_records
from .jsonl_output import JsonLines
from .results import RowResults
from .stopping import decode_text

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# body fields -> the prompt line's key (a null value is as if absent, as OpenAI takes it)
SHARED_FIELDS = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "n": "n",
                 "stop": "stop", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty",
                 # vLLM's extra sampling parameters
                 "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids"}
CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = {"prompt", "max_tokens", "logprobs"}
# metadata a request may carry that changes nothing hpcpar computes
IGNORED_FIELDS = {"model", "user", "metadata", "store", "service_tier"}
# fields that do nothing at these values
NEUTRAL = {"stream": False, "echo": False, "best_of": 1, "logit_bias": {}, "suffix": ""}
NO_CUT = {"top_k": (0, -1), "top_p": (1, 1.0), "min_p": (0, 0.0)}   # vLLM's "off" values


@dataclass
class Request:
    """One line of a Batch API file: its ``custom_id``, its endpoint (``kind``: chat or
    completion), the model it names, and either its prompt's index among the served ones
    (``prompt``) with how it asked for log-probs, or why it is not served (``error``)."""

    custom_id: str
    kind: str | None = None
    model: str | None = None
    prompt: int | None = None
    logprobs: bool = False
    error: str | None = None
    names: dict = field(default_factory=dict)   # a prompt line's key -> the body's field

    @property
    def digest(self) -> str:
        """The request's ids' stem: from its custom_id, so a resumed run writes the same."""
        return hashlib.sha256(self.custom_id.encode()).hexdigest()[:24]

    def in_its_words(self, message: str) -> str:
        """``message`` with the prompt line's keys named as the request's body names them."""
        for key, name in self.names.items():
            message = re.sub(rf"\b{key}\b", name, message)
        return message


@dataclass
class Requests:
    """A Batch API file's requests, in input order."""

    items: list[Request]
    source: str

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.items if r.error is not None]

    def refuse(self, refused: dict[int, str]) -> None:
        """The requests of served prompts ``refused`` (prompt -> message) are not served
        after all: each gets its message as its error, and the later prompts' indices close
        up (one pass, however many are refused)."""
        gone = 0
        for r in self.items:
            if r.prompt is None:
                continue
            if r.prompt in refused:
                r.prompt, r.error = None, r.in_its_words(refused[r.prompt])
                gone += 1
            else:
                r.prompt -= gone

    def summary(self) -> str:
        failed = self.failed
        first = f"; the first: {failed[0].custom_id}: {failed[0].error}" if failed else ""
        return (f"{len(self.items)} requests, {len(self.items) - len(failed)} served, "
                f"{len(failed)} failed{first}")


def is_batch_request(record) -> bool:
    """Whether a parsed line is an OpenAI Batch API request."""
    return isinstance(record, dict) and "body" in record and ("custom_id" in record
                                                                or "url" in record)


def is_batch_file(path: str | Path) -> bool:
    """Whether a prompts file is a ``.jsonl`` whose first line is a Batch API request."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        return is_batch_request(json.loads(first))
    except (OSError, ValueError):        # prompts.load_prompts says what is wrong
        return False


def load_requests(path: str | Path, tokenizer, chat, temperature: float = 0.0) -> Prompts:
    """The served requests' prompts, with ``requests`` describing every request
    (``temperature``: the job's, which a request without its own runs at)."""
    path = Path(path)
    records = read_records(path)
    items, lines, seen = [], [], set()
    for n, record in records:
        if not is_batch_request(record):
            raise PromptError(f"{path}:{n}: a Batch API file holds requests only, each with "
                              "\"custom_id\", \"method\", \"url\" and \"body\"; this line is "
                              "not one")
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise PromptError(f"{path}:{n}: \"custom_id\" must be a non-empty string")
        if custom_id in seen:
            raise PromptError(f"{path}:{n}: custom_id {custom_id!r} is already used; each "
                              "request needs its own")
        seen.add(custom_id)
        request = Request(custom_id)
        try:
            line, request.kind, request.model, request.logprobs = _served(
                record, tokenizer, chat, f"{path}:{n}", temperature, request.names)
            request.prompt = len(lines)
            lines.append(line)
        except HpcparError as e:
            request.error = request.in_its_words(str(e).removeprefix(f"{path}:{n}: "))
        items.append(request)
    requests = Requests(items, str(path))
    if not lines:
        raise PromptError(f"{path}: no request can be served: {requests.summary()}")
    return Prompts.of(lines, requests)


def _served(record: dict, tokenizer, chat, where: str, temperature: float, names: dict):
    """(prompt line, kind, model, logprobs asked) of a request hpcpar can serve; ``names``
    gets the body's names of the line's keys (for its messages)."""
    unknown = sorted(set(record) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise PromptError(f"{where}: unknown key {unknown[0]!r} in a request")
    if record.get("method", "POST") != "POST":
        raise PromptError(f"{where}: method {record.get('method')!r}: requests are POST")
    kind = URLS.get(record.get("url"))
    if kind is None:
        raise PromptError(f"{where}: url {record.get('url')!r} is not served; hpcpar serves "
                          f"{' and '.join(URLS)}")
    body = record["body"]
    if not isinstance(body, dict):
        raise PromptError(f"{where}: \"body\" must be an object")
    body = {k: v for k, v in body.items() if v is not None}
    allowed = set(SHARED_FIELDS) | IGNORED_FIELDS | (CHAT_FIELDS if kind == "chat"
                                                     else COMPLETION_FIELDS)
    for key in sorted(body):
        if key in NEUTRAL and body[key] == NEUTRAL[key]:
            continue
        if key not in allowed:
            raise PromptError(f"{where}: {key!r} is not supported by hpcpar's "
                              f"{record['url']}" + (f" (only its neutral value, "
                                                    f"{json.dumps(NEUTRAL[key])}, is taken)"
                                                    if key in NEUTRAL else ""))
    line = {SHARED_FIELDS[k]: v for k, v in body.items() if k in SHARED_FIELDS}
    for cut, off in NO_CUT.items():            # a cut at its neutral value: none
        if line.get(cut) in off:
            del line[cut]
    if line.get("temperature", temperature) == 0:     # greedy: a cut is moot (OpenAI takes it)
        for cut in NO_CUT:
            line.pop(cut, None)
    for name in ("max_completion_tokens", "max_tokens"):
        if name in body:
            line["max_new_tokens"], names["max_new_tokens"] = body[name], name
            break
    line["logprobs"] = None                     # none unless the request asks
    asked = False
    if kind == "chat":
        if "messages" not in body:
            raise PromptError(f"{where}: a chat completion needs \"messages\"")
        line["messages"] = body["messages"]
        asked = body.get("logprobs", False)
        if not isinstance(asked, bool):
            raise PromptError(f"{where}: \"logprobs\" must be true or false")
        if "top_logprobs" in body and not asked:
            raise PromptError(f"{where}: \"top_logprobs\" needs \"logprobs\": true")
        if asked:
            line["logprobs"] = body.get("top_logprobs", 0)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            line["text"] = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            line["ids"] = prompt
        else:
            raise PromptError(f"{where}: \"prompt\" must be a string or a list of token ids "
                              "(one prompt per request)")
        if "logprobs" in body:
            line["logprobs"], asked = body["logprobs"], True
    # the line's log-probs are the body's top_logprobs in a chat (named so from here on:
    # the checks above name the body's own fields)
    names["logprobs"] = "top_logprobs" if kind == "chat" else "logprobs"
    model = body.get("model")
    return (prompt_line(line, tokenizer, chat, where), kind,
            model if isinstance(model, str) else None, asked)


def screen(prompts: Prompts, check) -> Prompts:
    """``prompts`` less those whose request ``check(one_prompt)`` refuses (a
    ``PromptError``): those requests get its message as their error."""
    requests: Requests = prompts.requests
    kept, refused = [], {}
    for i in range(len(prompts)):
        try:
            check(prompts.take([i]), "the request")
            kept.append(i)
        except HpcparError as e:
            refused[i] = str(e).removeprefix("the request: ").replace("prompt 0 ",
                                                                        "the prompt ", 1)
    requests.refuse(refused)
    if not kept:
        raise PromptError(f"{requests.source}: no request can be served: "
                          f"{requests.summary()}")
    return prompts.take(kept) if len(kept) < len(prompts) else prompts


class BatchLines(JsonLines):
    """The Batch API output lines, one per request in input order: a served request's
    once all its samples are finished, a refused one's error as its turn comes."""

    def __init__(self, path: Path, requests: Requests, samples, describe, entries, tokenizer,
                 checkpoint: str):
        """``describe(row, tokens_row, length)``: text and finish reason;
        ``entries(row, results)``: the row's token log-prob entries
        (``validation.logprob_fields``);
        ``tokenizer``: the checkpoint's (a ``StoredTokenizer``: texts and tokens' bytes);
        ``samples``: the rows of each prompt."""
        super().__init__(path, describe)
        self.requests, self.samples, self.entries = requests, samples, entries
        self.tokenizer = tokenizer
        self.model, self.created = checkpoint, int(time.time())
        self.next = 0                                   # the next request to write

    def start(self) -> None:
        super().start()
        self.next = 0                                   # the next request to write

    def extend(self, results: RowResults, done: np.ndarray, prompt_lengths: np.ndarray) -> None:
        wrote = False
        while self.next < len(self.requests.items):
            request = self.requests.items[self.next]
            if request.prompt is None:
                line = self._line(request, None, _error(request.error))
            else:
                rows = self._rows(request.prompt)
                if not done[rows].all():
                    break
                line = self._line(request, self._body(request, rows, results,
                                                      int(prompt_lengths[rows[0]])), None)
            self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.next, wrote = self.next + 1, True
        if wrote:
            self.flush()

    def _rows(self, prompt: int) -> np.ndarray:
        width = self.samples.width
        return prompt * width + np.arange(int(self.samples.counts[prompt]))

    def _line(self, request: Request, body: dict | None, error: dict | None) -> dict:
        digest = request.digest
        response = None if body is None else {"status_code": 200,
                                              "request_id": f"hpcpar-{digest}", "body": body}
        return {"id": f"batch_req_{digest}", "custom_id": request.custom_id,
                "response": response, "error": error}

    def _body(self, request: Request, rows: np.ndarray, results: RowResults,
              prompt_tokens: int) -> dict:
        chat = request.kind == "chat"
        choices = []
        for s, row in enumerate(rows):
            n = int(results.lengths[row])
            text, reason = self.describe(row, results.tokens[row], n)
            text = text if text is not None else ""
            choice = {"index": s}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            entries = self.entries(row, results).get("logprobs") if request.logprobs else None
            choice["logprobs"] = (None if entries is None else
                                  _chat_logprobs(entries, self.tokenizer) if chat
                                  else _completion_logprobs(entries, self.tokenizer))
            choice["finish_reason"] = "length" if reason == "length" else "stop"
            choices.append(choice)
        completion = int(results.lengths[rows].sum())
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request.digest}",
                "object": "chat.completion" if chat else "text_completion",
                "created": self.created, "model": request.model or self.model,
                "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}


def _error(message: str) -> dict:
    return {"code": "invalid_request", "message": message}


def _token(entry: dict) -> str:
    return entry.get("token", f"token_id:{entry['token_id']}")


def _chat_logprobs(entries: list[dict], tokenizer) -> dict:
    """OpenAI's chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}, each
    token's ``bytes`` its own (a character split over tokens is their bytes joined)."""
    def one(e):
        return {"token": _token(e), "logprob": e["logprob"],
                "bytes": list(tokenizer.token_bytes(e["token_id"]))}
    return {"content": [one(e) | {"top_logprobs": [one(a) for a in e["top_logprobs"]]}
                        for e in entries]}


def _completion_logprobs(entries: list[dict], tokenizer) -> dict:
    """OpenAI's legacy completion ``logprobs``: parallel lists, and each token's offset in
    the completion's text (the length of the text of the tokens before it)."""
    ids = [e["token_id"] for e in entries]
    offsets = [len(decode_text(tokenizer, ids[:t])) for t in range(len(ids))]
    return {"tokens": [_token(e) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token(a): a["logprob"] for a in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


__all__ = ["BatchLines", "Request", "Requests", "is_batch_file", "load_requests", "screen"]
