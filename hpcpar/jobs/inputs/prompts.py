"""Reading and checking prompts: a ``.npy`` of token ids, a ``.jsonl`` of ids or text, or
random ids for demos and benchmarks. Every problem is one line naming the file and the row."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ...models.chat import check_messages, one_line, unicode_problem
from ...models.config import ModelConfig
from ...models.tokenizer import StoredTokenizer
from ...parallel.errors import HpcparError
from ..npy import read_npy
from ..settings import problem
from .sampling_settings import INTEGER_KEYS, PromptSampling, SamplingParams


class PromptError(HpcparError):
    pass


# the keys a .jsonl prompt line may hold: one of ids / text, and per-prompt settings
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "min_tokens", "logprobs",
                 "prompt_logprobs")
OPTIONAL_KEYS = ("logprobs", "prompt_logprobs")     # null: none, as when absent
SOURCE_KEYS = ("ids", "text", "messages")          # what a line's prompt is given as
PROMPT_KEYS = (*SOURCE_KEYS, "max_new_tokens", "n", "stop", "stop_token_ids", *SAMPLING_KEYS)
CHAT_FOR_GENERATION = "for generation"   # ``chat`` of a reader whose lines may not be chats


@dataclass(frozen=True)
class Prompts:
    ids: list[np.ndarray]               # one int64 array per prompt, lengths may differ
    texts: list[str] | None = None      # the source text, when prompts were given as text
    max_new_tokens: list[int | None] | None = None   # a prompt's own limit (None: the job's)
    sampling: list[dict] | None = None  # a prompt's own sampling settings (absent: the job's)
    stops: list[tuple[str, ...] | None] | None = None  # a prompt's own stop strings
    stop_ids: list[tuple[int, ...] | None] | None = None    # its own stop_token_ids
    samples: list[int | None] | None = None     # its own n, samples drawn (None: the job's)
    requests: object = None     # the OpenAI Batch API requests they serve (``batch_api``)

    def __post_init__(self):
        """Each prompt a 1-D array of integer ids (a list of ints is taken as one): a float
        id would be cut to an integer without a word, a 2-D array read as one long row."""
        ids = []
        for n, row in enumerate(self.ids):
            row = np.asarray(row)
            if row.ndim != 1 or (row.size and row.dtype.kind not in "iu"):
                raise PromptError(f"Prompts: prompt {n} is a {row.ndim}-D array of "
                                  f"{row.dtype}; each prompt is a 1-D array of integer token "
                                  f"ids (one array per prompt)")
            ids.append(row.astype(np.int64, copy=False))
        object.__setattr__(self, "ids", ids)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, lines: list["PromptLine"], requests=None) -> "Prompts":
        """Prompts of checked lines (a setting no line has: None, the job's for all)."""
        def column(name: str):
            values = [getattr(line, name) for line in lines]
            return values if any(v is not None and v != {} for v in values) else None
        return cls([line.ids for line in lines], column("text"), column("max_new_tokens"),
                   column("sampling"), column("stops"), column("stop_ids"), column("samples"),
                   requests)

    def limits(self, job_max: int) -> np.ndarray:
        """(prompts,) the new tokens each prompt may get: its own limit, else the job's."""
        own = self.max_new_tokens or [None] * len(self)
        return np.array([job_max if k is None else k for k in own], dtype=np.int64)

    def samples_for(self, job_n: int) -> np.ndarray:
        """(prompts,) the samples each prompt gets: its own n, else the job's."""
        own = self.samples or [None] * len(self)
        return np.array([job_n if n is None else n for n in own], dtype=np.int64)

    def repeated(self, times: int) -> "Prompts":
        """Each prompt ``times`` times in a row (one row per sample), its settings with it."""
        def rep(values):
            return None if values is None else [v for v in values for _ in range(times)]
        return Prompts(rep(self.ids), rep(self.texts), rep(self.max_new_tokens),
                       rep(self.sampling), rep(self.stops), rep(self.stop_ids),
                       rep(self.samples), self.requests)

    def take(self, indices) -> "Prompts":
        """The prompts ``indices``, their settings with them."""
        def pick(values):
            return None if values is None else [values[i] for i in indices]
        return Prompts(pick(self.ids), pick(self.texts), pick(self.max_new_tokens),
                       pick(self.sampling), pick(self.stops), pick(self.stop_ids),
                       pick(self.samples), self.requests)

    def sampling_for(self, job: SamplingParams) -> PromptSampling:
        """Each prompt's sampling settings: its own, else the job's."""
        return PromptSampling.build(job, self.sampling or [{}] * len(self))

    @cached_property
    def lengths(self) -> list[int]:
        """Each prompt's length (computed once: callers index it prompt by prompt)."""
        return [len(p) for p in self.ids]


def load_prompts(path: str | Path, tokenizer=None, chat=CHAT_FOR_GENERATION) -> Prompts:
    """Prompts from ``path``: ``.npy`` int array (batch, seq), or ``.jsonl`` whose lines are
    ``{"ids": [...]}``, ``{"text": "..."}`` (text needs ``tokenizer``) or, for generation,
    ``{"messages": [...]}`` rendered with ``chat`` (the checkpoint's ``ChatTemplate``, None
    when it has none); other readers leave ``chat`` out and refuse conversations."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"{path}: no such prompt file; pass a .npy of token ids or a .jsonl "
                          "with {\"ids\": [...]} or {\"text\": \"...\"} per line")
    if path.suffix == ".npy":
        return _load_npy(path)
    if path.suffix in (".jsonl", ".json"):
        return _load_jsonl(path, tokenizer, chat)
    raise PromptError(f"{path}: prompts must be a .npy or .jsonl file, not {path.suffix or 'a file without suffix'}")


def _load_npy(path: Path) -> Prompts:
    array = read_npy(path, "the prompts' token ids (int, [prompts, tokens])", PromptError)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise PromptError(f"{path}: expected an integer array [batch, seq], got {array.dtype} "
                          f"{list(array.shape)}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise PromptError(f"{path}: holds no prompts (shape {list(array.shape)})")
    return Prompts([row.astype(np.int64) for row in array])


def read_records(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of a UTF-8 ``.jsonl`` file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the "
                          "prompt file as UTF-8") from None
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((n, json.loads(line, object_pairs_hook=_unique_keys)))
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") \
                from None
        except _RepeatedKey as e:
            raise PromptError(f"{path}:{n}: the key {e} appears twice in one object; JSON "
                              f"readers disagree on which one counts: keep one") from None
    return records


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are each given once (``json`` keeps the last silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(repr(key))
        out[key] = value
    return out


def _load_jsonl(path: Path, tokenizer, chat) -> Prompts:
    records = read_records(path)
    if not records:
        raise PromptError(f"{path}: the prompt file is empty; add one JSON object per line")
    return Prompts.of([prompt_line(record, tokenizer, chat, f"{path}:{n}")
                       for n, record in records])


@dataclass(frozen=True)
class PromptLine:
    """One prompt line, checked: its ids, text and own settings (None / {}: the job's)."""

    ids: np.ndarray
    text: str | None = None
    max_new_tokens: int | None = None
    sampling: dict = field(default_factory=dict)
    stops: tuple[str, ...] | None = None
    stop_ids: tuple[int, ...] | None = None
    samples: int | None = None


def prompt_line(record, tokenizer, chat, where: str) -> PromptLine:
    """A ``.jsonl`` prompt line's prompt and settings; any problem is one ``PromptError``
    naming ``where``."""
    if isinstance(record, dict) and "body" not in record and ("custom_id" in record
                                                               or "url" in record):
        raise PromptError(f"{where}: a Batch API request needs its \"body\" (the "
                          "request's fields: \"messages\" or \"prompt\", max_tokens, ...)")
    if not isinstance(record, dict) or sum(k in record for k in SOURCE_KEYS) != 1:
        raise PromptError(f"{where}: each line needs exactly one of \"ids\", \"text\" "
                          "or \"messages\"")
    bad = _invalid_text(record)
    if bad:
        raise PromptError(f"{where}: {bad[0]} holds invalid Unicode ({bad[1]}): a JSON "
                          "\\ud800-\\udfff escape must be one of a pair; fix the line")
    unknown = sorted(set(record) - set(PROMPT_KEYS))
    if unknown:
        raise PromptError(f"{where}: unknown key {unknown[0]!r}; a prompt line holds "
                          f"{' / '.join(repr(k) for k in PROMPT_KEYS)}")
    limit = _own_count(record, "max_new_tokens", where)
    samples = _own_count(record, "n", where)
    sampling = _own_sampling(record, where)
    stops, stop_ids = _own_stops(record, where), _own_stop_ids(record, where)
    ids, text = _line_ids(record, tokenizer, chat, where)
    if len(ids) == 0:
        raise PromptError(f"{where}: the prompt is empty (no tokens)")
    return PromptLine(ids, text, limit, sampling, stops, stop_ids, samples)


def _own_count(record: dict, key: str, where: str) -> int | None:
    """A line's own ``max_new_tokens`` or ``n`` (an integer in the job setting's range)."""
    value = record.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise PromptError(f"{where}: \"{key}\" must be an integer, got {json.dumps(value)}")
    wrong = problem(f"generate.{key}", value)
    if wrong:                                       # the line's key, without the section
        raise PromptError(f"{where}: {wrong.removeprefix('generate.')}")
    return value


def _line_ids(record: dict, tokenizer, chat, where: str) -> tuple[np.ndarray, str | None]:
    """A line's prompt ids, and its text when it was given as text or a conversation."""
    if "ids" in record:
        row = record["ids"]
        if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in row):
            raise PromptError(f"{where}: \"ids\" must be a list of integers")
        if any(not -2 ** 63 <= t < 2 ** 63 for t in row):
            raise PromptError(f"{where}: token id {max(row, key=abs)} is out of range")
        return np.asarray(row, dtype=np.int64), None
    if tokenizer is None:
        raise PromptError(f"{where}: text and conversations need the tokenizer, and this "
                          "checkpoint has none; convert the model from a Hugging Face folder "
                          "that holds tokenizer.json, or give token ids")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise PromptError(f"{where}: \"text\" must be a string")
        tokenizer = _parsed(tokenizer, where, "text")
        return _encode(tokenizer, record["text"], True, where, "text"), record["text"]
    if chat is CHAT_FOR_GENERATION:
        raise PromptError(f"{where}: \"messages\" lines are conversations for generation; "
                          "give \"ids\" or \"text\" here")
    if chat is None:
        raise PromptError(f"{where}: a \"messages\" line is rendered with the checkpoint's chat "
                          "template, and this checkpoint has none; convert from a Hugging Face "
                          "folder whose tokenizer_config.json or chat_template.jinja holds one, "
                          "or give the prompt as \"text\"")
    messages = check_messages(record["messages"], where)
    tokenizer = _parsed(tokenizer, where, "a conversation")
    text = chat.render(messages, where)
    # the template writes the special tokens itself, as apply_chat_template's tokenizing does
    return _encode(tokenizer, text, False, where, "a conversation"), text


def _parsed(tokenizer, where: str, what: str):
    """The tokenizer itself: the checkpoint's is read on first use, and one that cannot be
    is an error naming the line that needed it."""
    if isinstance(tokenizer, StoredTokenizer):
        return tokenizer.require(f"{where}: {what} needs the tokenizer, and ")
    return tokenizer


def _encode(tokenizer, text: str, special: bool, where: str, what: str) -> np.ndarray:
    """``text``'s ids; a tokenizer that fails is one error naming the line."""
    try:
        return np.asarray(tokenizer.encode(text, add_special_tokens=special).ids, np.int64)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:                        # noqa: BLE001 (tokenizers' panics too)
        raise PromptError(f"{where}: the tokenizer failed on the {what} "
                          f"({type(e).__name__}: {one_line(e)})") from None


def _invalid_text(value, place: str = "") -> tuple[str, str] | None:
    """The first string of a prompt line (a key or a value, token ids aside) that is not
    valid Unicode: (where in the line, what is wrong), or None."""
    if isinstance(value, str):
        bad = unicode_problem(value)
        return (place, bad) if bad else None
    if isinstance(value, dict):
        for key, item in value.items():
            if place == "" and key == "ids":
                continue                                  # integers, checked on their own
            found = (_invalid_text(key, f"{place or 'the line'}'s key {json.dumps(key)}")
                     or _invalid_text(item, f"{place}[{json.dumps(key)}]" if place
                                      else json.dumps(key)))
            if found:
                return found
    elif isinstance(value, list):
        for k, item in enumerate(value):
            found = _invalid_text(item, f"{place}[{k}]")
            if found:
                return found
    return None


def _own_stops(record: dict, where: str) -> tuple[str, ...] | None:
    """A line's own stop strings: a string or a list of them, none empty."""
    if "stop" not in record:
        return None
    value = record["stop"]
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise PromptError(f"{where}: \"stop\" must be a non-empty string or a list of them, "
                          f"got {json.dumps(record['stop'])[:80]}")
    return tuple(value)


def _own_stop_ids(record: dict, where: str) -> tuple[int, ...] | None:
    """A line's own ``"stop_token_ids"`` (a list of ids), or None."""
    if "stop_token_ids" not in record:
        return None
    value = record["stop_token_ids"]
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              and 0 <= t < 2 ** 63 for t in value):
        raise PromptError(f"{where}: \"stop_token_ids\" must be a list of token ids (integers "
                          f">= 0), got {json.dumps(value)[:80]}")
    return tuple(value)


def _own_sampling(record: dict, where: str) -> dict:
    """A prompt line's sampling settings, each checked as the job's are."""
    own = {key: record[key] for key in SAMPLING_KEYS if key in record}
    for key, value in own.items():
        if value is None and key in OPTIONAL_KEYS:
            continue
        whole = key in INTEGER_KEYS
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise PromptError(f"{where}: \"{key}\" must be {'an integer' if whole else 'a number'}"
                              f", got {json.dumps(value)}")
    problems = SamplingParams(**own).problems()
    if problems:                                    # the line's key, without the section
        raise PromptError(f"{where}: {problems[0].removeprefix('generate.')}")
    return own


def random_prompts(count: int, lengths: tuple[int, int], vocab_size: int,
                   seed: int = 0) -> Prompts:
    """``count`` prompts of random ids with lengths drawn from [lo, hi] (for demos and
    benchmarks); the same on every rank for a given seed."""
    lo, hi = lengths
    if count < 1 or not 1 <= lo <= hi:
        raise PromptError(f"random prompts need count >= 1 and 1 <= min length <= max length, "
                          f"got count {count}, lengths [{lo}, {hi}]")
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lo, hi + 1, size=count)
    return Prompts([rng.integers(0, vocab_size, size=int(n), dtype=np.int64) for n in sizes])


def check_prompts(prompts: Prompts, cfg: ModelConfig, max_new_tokens: int,
                  source: str) -> None:
    """Every prompt fits the model: ids in [0, vocab_size), prompt plus new tokens within
    max_position_embeddings."""
    if len(prompts) == 0:
        raise PromptError(f"{source}: no prompts")
    limits = prompts.limits(max_new_tokens)
    for n, row in enumerate(prompts.ids):
        if limits[n] > max_new_tokens:
            raise PromptError(f"{source}: prompt {n} asks for max_new_tokens {limits[n]}, more "
                              f"than the job's {max_new_tokens}; raise --max-new-tokens or "
                              "lower the prompt's")
        if len(row) == 0:
            raise PromptError(f"{source}: prompt {n} is empty")
        bad = row[(row < 0) | (row >= cfg.vocab_size)]
        if bad.size:
            raise PromptError(f"{source}: prompt {n} holds token id {int(bad[0])}, outside the "
                              f"model's vocabulary [0, {cfg.vocab_size})")
        positions, field = cfg.positions
        if len(row) >= positions:
            raise PromptError(f"{source}: prompt {n} has {len(row)} tokens, and the model "
                              f"holds {positions} positions in all ({field}); shorten it to at "
                              f"most {positions - 1} tokens to leave room for a new one")
        if len(row) + limits[n] > positions:
            raise PromptError(f"{source}: prompt {n} has {len(row)} tokens, which plus "
                              f"{limits[n]} new tokens exceeds the model's {field}; lower "
                              f"max_new_tokens to {positions - len(row)} or shorten the prompt")
