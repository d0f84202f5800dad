"""A generation output for ``show``: HDF5 (a row per prompt, or per sample of a prompt),
hpcpar's JSON lines, or an OpenAI Batch API output file. What a damaged or hand-edited file
still holds is shown; what is not is said in one note: an HDF5 dataset missing or of another
type leaves its column empty ("-"), a JSON line with a field hpcpar never writes so (a null
index, a count as text) or a request line without its body is left out."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np

from ...checkpoint.files import BATCH_KEYS, JSONL_KEYS, JSONL_OPTIONAL_KEYS
from ...parallel.errors import HpcparError
from .reading import (Cells, Unreadable, attributes, counts, dataset, is_count, lines_note,
                      not_an_output, page_of, reasons, text, whole)

ROW_DATASETS = ("lengths", "finish_reason", "tokens", "text")     # any one of them: the rows
KIND_LINES = 100            # lines read to tell a generation's JSON lines from another file


def generation_h5(path: Path, page: int, per_page: int) -> dict:
    """Each dataset read on its own; the rows are as many as the first one read holds."""
    import h5py
    problems: list[str] = []
    with h5py.File(path, "r") as f:
        attrs = attributes(f, problems)
        data = {name: dataset(f, name, "strings" if name in ("finish_reason", "text")
                              else "integers", problems, expected=name != "text")
                for name in ROW_DATASETS}
        data["prompt_lengths"] = dataset(f, "prompt_lengths", "integers", problems)
        # a sample axis: n > 1 (each prompt's count in "samples")
        sampled = "samples" in f or any(data[n] is not None and data[n].ndim > 1
                                        for n in ("lengths", "finish_reason", "text"))
        samples = dataset(f, "samples", "integers", problems) if sampled else None
    held = [data[n] for n in ROW_DATASETS if data[n] is not None]
    if not held:
        raise HpcparError(f"{path}: a generation output without its lengths, finish_reason, "
                          "tokens or text; nothing to show; generate it again")
    prompts = len(held[0])
    cells = Cells()
    rows = _h5_rows(data, prompts, _sample_counts(samples, prompts, sampled, held, problems),
                    cells)
    lengths = [r["completion_tokens"] for r in rows if r["completion_tokens"] is not None]
    problems += cells.problems()
    report = {k[len("report_"):]: v for k, v in attrs.items() if k.startswith("report_")}
    return {"kind": "generation", "path": str(path), "prompts": prompts,
            **({"samples": len(rows)} if sampled else {}),
            "finish_reasons": counts([r["finish_reason"] for r in rows]),
            "completion_tokens": sum(lengths) if data["lengths"] is not None else None,
            "report": report, **page_of(rows, page, per_page),
            "notes": ["not read: " + "; ".join(problems)] if problems else []}


def _sample_counts(samples, prompts: int, sampled: bool, held: list,
                   problems: list[str]) -> np.ndarray | None:
    """Each prompt's samples (None: no sample axis). Without a readable count, every slot of
    the axis is shown (the ones past a prompt's n hold nothing)."""
    if not sampled:
        return None
    if samples is not None and samples.shape == (prompts,) and (samples >= 0).all():
        return samples
    if samples is not None:
        problems.append("samples (not one count per prompt)")
    problems[-1] += ": every sample slot shown"      # the problem with samples, said last
    return np.full(prompts, max((a.shape[1] for a in held if a.ndim > 1), default=1))


def _h5_rows(data: dict, prompts: int, samples: np.ndarray | None, cells: Cells) -> list[dict]:
    rows = []
    for i in range(prompts):
        prompt = {"index": i,
                  "prompt_tokens": cells.get(data["prompt_lengths"], i, "prompt_lengths", whole)}
        for s in range(1) if samples is None else range(int(samples[i])):
            at = i if samples is None else (i, s)
            length = cells.get(data["lengths"], at, "lengths", whole)
            ids = None if length is None else cells.get(
                data["tokens"], at, "tokens", lambda row, n=length: _ids(row, n))
            rows.append(prompt | ({} if samples is None else {"sample": s}) | {
                "finish_reason": cells.get(data["finish_reason"], at, "finish_reason", text),
                "completion_tokens": length,
                "text": cells.get(data["text"], at, "text", text),
                "token_ids": ids})
    return rows


def _ids(row, length: int) -> list[int]:
    """A row's first ``length`` token ids (a length past the row is damage, not a cut)."""
    if not isinstance(row, np.ndarray) or row.ndim != 1 or length > len(row):
        raise ValueError(length)
    return row[:length].tolist()


def generation_jsonl(path: Path, page: int, per_page: int) -> dict:
    """hpcpar's own JSON lines or a Batch API output, told apart by the first lines."""
    kind = next((k for _, r in islice(_records(path), KIND_LINES)
                 if (k := _line_kind(r)) is not None), None)
    if kind is None:
        raise not_an_output(path)
    read = _own_rows if kind == "own" else _batch_rows
    lines, unread, total = [], {}, 0
    for n, record in _records(path):
        total += 1
        try:
            if isinstance(record, Unreadable):
                raise record
            if _line_kind(record) != kind:
                raise Unreadable(_STRAY[_line_kind(record)])
            lines.append(read(record))
        except Unreadable as e:
            unread[n] = str(e)
    if not lines:
        raise HpcparError(f"{path}: none of its {total} lines could be read "
                          f"({reasons(unread)}); generate it again, or mend those lines")
    notes = [lines_note(unread, total)] if unread else []
    if kind == "batch":
        return _batch_output(path, lines, page, per_page) | {"notes": notes}
    rows = sorted((row for line in lines for row in line),
                  key=lambda r: (r["index"], r.get("sample", 0)))
    return {"kind": "generation", "path": str(path),
            "prompts": len({r["index"] for r in rows}),
            **({"samples": len(rows)} if any("sample" in r for r in rows) else {}),
            "finish_reasons": counts([r["finish_reason"] for r in rows]),
            "completion_tokens": sum(r["completion_tokens"] for r in rows), "report": {},
            **page_of(rows, page, per_page), "notes": notes}


def _records(path: Path):
    """Each non-blank line's number and its JSON value (``Unreadable`` if it has none)."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except ValueError:                      # torn, or not UTF-8
                yield n, Unreadable("not JSON")


def _line_kind(record) -> str | None:
    """"own" (hpcpar's line of a prompt), "batch" (a Batch API output line) or None, by the
    keys (in any order: a tool that rewrote the file may have sorted them)."""
    if not isinstance(record, dict):
        return None
    keys = set(record)
    if keys == set(BATCH_KEYS):
        return "batch"
    if set(JSONL_KEYS) <= keys <= set(JSONL_KEYS + JSONL_OPTIONAL_KEYS):
        return "own"
    return None


# why a line of another kind than the file's was not read, by its kind
_STRAY = {None: "not a generation output's line (other keys)",
          "own": "one of hpcpar's own lines among Batch API lines",
          "batch": "a Batch API line among hpcpar's own lines"}
# the fields hpcpar's lines show, each as hpcpar writes it (text is null without a tokenizer)
_OWN_FIELDS = {"index": is_count, "sample": is_count,
               "finish_reason": lambda v: isinstance(v, str),
               "prompt_tokens": is_count, "completion_tokens": is_count,
               "text": lambda v: v is None or isinstance(v, str),
               "token_ids": lambda v: isinstance(v, list) and all(map(is_count, v))}


def _own_rows(record: dict) -> list[dict]:
    wrong = [k for k, ok in _OWN_FIELDS.items() if k in record and not ok(record[k])]
    if wrong:
        raise Unreadable(f"a null or mistyped {', '.join(wrong)}")
    return [record]


def _batch_rows(line: dict) -> list[dict]:
    """A request's rows: one per choice (its custom_id as the index), or its error as one."""
    custom_id, error, response = line["custom_id"], line["error"], line["response"]
    if not isinstance(custom_id, str):
        raise Unreadable("a custom_id that is not a string")
    if error is not None or not response:
        return [{"index": custom_id, "finish_reason": "error", "prompt_tokens": None,
                 "completion_tokens": 0, "text": _message(error), "token_ids": []}]
    body = response.get("body") if isinstance(response, dict) else None
    if not isinstance(body, dict):
        raise Unreadable("a response without a body")
    usage, choices = body.get("usage"), body.get("choices")
    if not (isinstance(usage, dict) and is_count(usage.get("prompt_tokens"))
            and is_count(usage.get("completion_tokens"))):
        raise Unreadable("a body without its usage")
    if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
        raise Unreadable("a body without its choices")
    rows = [_choice_row(custom_id, c, len(choices) > 1, usage["prompt_tokens"])
            for c in choices]
    if len(rows) == 1:                      # usage counts the request: its one choice's
        rows[0]["completion_tokens"] = usage["completion_tokens"]
    rows[0]["usage"] = {"completion_tokens": usage["completion_tokens"]}   # the request's
    return rows


def _choice_row(custom_id: str, choice: dict, sampled: bool, prompt_tokens: int) -> dict:
    message = choice.get("message")
    said = message.get("content") if isinstance(message, dict) else choice.get("text")
    reason, index = choice.get("finish_reason"), choice.get("index")
    if not (isinstance(reason, str) and (said is None or isinstance(said, str))
            and (is_count(index) or not sampled)):
        raise Unreadable("a choice without its text, finish_reason or index")
    return {"index": custom_id, **({"sample": index} if sampled else {}),
            "finish_reason": reason, "prompt_tokens": prompt_tokens,
            "completion_tokens": _choice_tokens(choice), "text": said, "token_ids": []}


def _choice_tokens(choice: dict) -> int | None:
    """A choice's own new tokens, where its log-probs list them (usage counts the request's
    choices together); None otherwise."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    listed = logprobs.get("content", logprobs.get("tokens"))
    return len(listed) if isinstance(listed, list) else None


def _message(error) -> str:
    if error is None:
        return "no response"
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return error if isinstance(error, str) else json.dumps(error)


def _batch_output(path: Path, requests: list[list[dict]], page: int, per_page: int) -> dict:
    rows = [row for request in requests for row in request]
    failed = sum(1 for request in requests if request[0]["finish_reason"] == "error")
    return {"kind": "generation", "path": str(path), "prompts": len(requests),
            "requests": {"served": len(requests) - failed, "failed": failed},
            "finish_reasons": counts([r["finish_reason"] for r in rows]),
            "completion_tokens": sum(request[0].get("usage", {}).get("completion_tokens", 0)
                                     for request in requests),
            "report": {}, **page_of(rows, page, per_page)}
