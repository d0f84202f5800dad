"""The output file of a generation job, written by rank 0 as the job goes and renamed into
place when complete.

    tokens         int64 [batch, max_new_tokens]   new tokens only; pad id after a row's EOS
    lengths        int64 [batch]                   new tokens up to and including EOS
    finish_reason  utf-8 [batch]                   why the row ended: eos, stop (a stop
                                                   string), or length (its max_new_tokens)
    prompt_lengths int64 [batch]
    prompt_logits  float32 [prompts, seq, vocab]   with --save-logits: position t of prompt b
                                                   at [b, t], NaN past the prompt's end
    text           utf-8 [batch]                   decoded new tokens, when there is a tokenizer
    logprobs, top_logprobs, top_token_ids          with --logprobs K: [batch, max_new_tokens]
                                                   and [batch, max_new_tokens, K]
    prompt_logprobs, prompt_top_logprobs, prompt_top_token_ids    with --prompt-logprobs K,
                                                   over [batch, longest prompt] (``results``)
    attributes     the run's settings and its report
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from ...checkpoint.files import (OUTPUT_KIND, WriteError, check_space, quiet_deallocation,
                                 remove_stale_temporaries, reserve, write_point, writing)
from ...parallel.errors import HpcparError
from .results import ResultShape, RowResults, Samples


def unpad_into(logits, mb, full: np.ndarray, width: int = 1) -> None:
    """A micro-batch's logits (b, L, vocab) into ``logits`` (an array or an HDF5 dataset of
    [prompts, seq, vocab]), position t of each prompt at t, its padding left out; with
    ``width`` samples per prompt, once per prompt (its first sample's row)."""
    for j, row in enumerate(mb.rows):
        if row % width == 0:
            logits[row // width, :mb.lengths[j]] = full[j, :mb.lengths[j]]


@dataclass(frozen=True)
class RunShape:
    """What a partial file of this run must hold: its settings (``run``, compared key by
    key on resume) and the shapes and limits its datasets follow."""

    run: dict                        # the settings a resumed run must share (``_fingerprint``)
    results: ResultShape             # the rows' results: one dataset each
    prompt_lengths: np.ndarray       # (count,)
    limits: np.ndarray               # (count,) each prompt's max_new_tokens
    vocab: int
    save_logits: bool
    samples: Samples | None = None   # the rows' prompts (None: one row per prompt)

    @property
    def present(self) -> np.ndarray:
        """(count,) the rows to run: every row, or each prompt's samples."""
        return (np.ones(self.count, bool) if self.samples is None
                else self.samples.present)

    @property
    def prompts(self) -> int:
        """The prompts (``count`` is their samples')."""
        return self.count // (1 if self.samples is None else self.samples.width)

    @property
    def count(self) -> int:
        return len(self.prompt_lengths)

    @property
    def max_new_tokens(self) -> int:
        return self.results.max_new_tokens

    @property
    def nbytes(self) -> int:
        """The partial file's datasets, in bytes."""
        n = self.count
        logits = (self.prompts * int(max(self.prompt_lengths)) * self.vocab * 4
                  if self.save_logits else 0)
        rows = sum(int(np.prod(row, dtype=np.int64)) * dtype.itemsize
                   for row, dtype, _ in self.results.specs().values())
        return n * (rows + 8 + 1) + logits


# the fingerprint's keys, as a refused resume names them
_SETTING_NAMES = {"checkpoint": "checkpoint path", "model": "model config",
                  "prompts_sha256": "prompts (their ids, limits or own sampling)",
                  "dtype": "compute dtype", "lora": "LoRA adapter (--lora)"}


def settings_differ(stored: dict, run: dict) -> list[str]:
    """The settings of ``run`` that differ from the stopped run's, as a user reads them."""
    out = []
    for key in sorted(set(stored) | set(run)):
        if stored.get(key) != run.get(key):
            name = _SETTING_NAMES.get(key, key)
            if key in ("checkpoint", "model", "prompts_sha256", "lora"):
                out.append(name)
            else:
                out.append(f"{name} {json.dumps(run.get(key))} (the stopped run had "
                           f"{json.dumps(stored.get(key))})")
    return out


_KIND_NAMES = {"i": "integers", "b": "booleans", "f": "floats"}


def stored_run(f: h5py.File) -> dict | None:
    """The settings a partial file was written under, or None when unreadable."""
    try:
        stored = json.loads(f.attrs["run"])
    except (KeyError, ValueError, TypeError):
        return None
    return stored if isinstance(stored, dict) else None


def damage(f: h5py.File, shape: RunShape) -> str | None:
    """What is wrong with the open partial file ``f`` of a run of ``shape``, or None: every
    dataset's presence, shape and type, then the finished rows' values."""
    n, width = shape.count, shape.max_new_tokens
    expected = {name: ((n,) + row, dtype.kind)
                for name, (row, dtype, _) in shape.results.specs().items()}
    expected |= {"prompt_lengths": ((n,), "i"), "done": ((n,), "b")}
    if shape.save_logits:
        expected["prompt_logits"] = ((shape.prompts, int(max(shape.prompt_lengths)),
                                      shape.vocab), "f")
    for name, (want, kind) in expected.items():
        dset = f.get(name)
        if not isinstance(dset, h5py.Dataset):
            return f"the {name} dataset is missing"
        if dset.shape != want or dset.dtype.kind != kind:
            return (f"{name} is {dset.dtype} {list(dset.shape)} where this run needs "
                    f"{_KIND_NAMES[kind]} {list(want)}")
    if not np.array_equal(f["prompt_lengths"][()], shape.prompt_lengths):
        return "its prompt lengths are not this run's prompts'"
    rows = np.flatnonzero(f["done"][()] & shape.present)
    lengths = f["lengths"][()][rows]
    bad = (lengths < 1) | (lengths > shape.limits[rows])
    if bad.any():
        row = int(rows[np.argmax(bad)])
        return (f"prompt {row} is marked finished with {int(f['lengths'][row])} new tokens, "
                f"outside [1, {int(shape.limits[row])}]")
    tokens = f["tokens"][()][rows]
    inside = np.arange(width)[None, :] < lengths[:, None]
    outside = inside & ((tokens < 0) | (tokens >= shape.vocab))
    if outside.any():
        r, t = np.argwhere(outside)[0]
        return (f"prompt {int(rows[r])} holds token id {int(tokens[r, t])}, outside the "
                f"model's vocabulary [0, {shape.vocab})")
    return None


def check_partial(path: Path, shape: RunShape) -> None:
    """Raise ``HpcparError`` unless ``path`` is a stopped run of ``shape`` that can be
    resumed: its settings first, then its contents (``damage``). Read-only: a refused file
    is left as it was, its modification time included."""
    differ, problem = [], None
    try:
        with h5py.File(path, "r") as f:
            stored = stored_run(f)
            if stored is None:
                problem = "its run settings are missing or unreadable"
            else:
                differ = settings_differ(stored, shape.run)
                problem = None if differ else damage(f, shape)
    except OSError as e:
        problem = f"not a readable HDF5 file ({str(e).splitlines()[0]})"
    if differ:
        raise HpcparError(f"{path}: a stopped run with other settings; this run has "
                          f"{'; '.join(differ)}; run it with the stopped run's settings, or "
                          f"remove {path} to start over")
    if problem is not None:
        raise HpcparError(f"{path}: cannot resume from it: damaged, {problem}; remove it to "
                          "start over")


def hdf5_texts(texts: list[str]) -> tuple[list[str], int]:
    """The texts as an HDF5 string can hold them, and how many changed: HDF5's strings end
    at a NUL, so a NUL a byte-level tokenizer decoded is stored as U+FFFD (the ``text``
    dataset's ``nul_replaced`` attribute counts the rows; the tokens are exact, and JSON
    lines keep the NUL)."""
    stored = [t.replace("\0", "\ufffd") for t in texts]
    return stored, sum(a != b for a, b in zip(stored, texts))


def by_prompt(values: np.ndarray, width: int) -> np.ndarray:
    """Rows (one per sample, ``width`` per prompt) as [prompts, width, ...]; unchanged with
    one sample per prompt. The prompts are counted, not left to ``reshape``: an array of no
    elements (``--logprobs 0``'s top alternatives, [rows, tokens, 0]) has no -1 to infer."""
    if width == 1:
        return values
    return values.reshape((len(values) // width, width) + values.shape[1:])


def regroup(f: h5py.File, results: ResultShape, samples: Samples) -> None:
    """A finished file's rows as a sample axis: each result [prompts, n, ...], the prompts'
    own (their lengths and log-probs) once per prompt, and ``samples``, each prompt's n."""
    for name in (*results.specs(), "prompt_lengths"):
        values = f[name][()]
        del f[name]
        own = name.startswith("prompt_")
        f.create_dataset(name, data=values[::samples.width] if own
                         else by_prompt(values, samples.width))
    f.create_dataset("samples", data=samples.counts)


class PartialOutput:
    """The output file while a generation runs (rank 0 only): a hidden sibling
    ``.NAME.partial`` that holds every dataset from the start, receives the finished
    prompts' tokens and lengths as they come (``generate.stream``) and each micro-batch's
    prompt logits as they are ready, and records which prompts are done and the run's
    settings; the text is decoded at the end. ``complete`` renames it into place; a run
    stopped early leaves it for ``resume="auto"``, which keeps the prompts it finished. The
    output path itself only ever holds a complete file.

    With ``lines`` (a ``.jsonl`` output, ``generate.jsonl_output``) the results go out as they
    finish, and the partial file is removed once they are complete.

    A write that fails (a full disk, a quota, a failing file system) is kept in ``failed``
    and ends the writing: the job then stops and reports it. The partial file is left only
    if it can still be resumed, and removed otherwise."""

    def __init__(self, path: str | Path, shape: RunShape, resume: str | None,
                 lines=None):
        self.path = Path(path)
        self.partial = self.path.with_name(f".{self.path.name}.partial")
        self.shape = shape
        self.failed: WriteError | None = None
        self.file: h5py.File | None = None
        self.lines = lines
        self.mirror = None          # (RowResults, done) in memory, for the lines
        remove_stale_temporaries(self.path)
        if resume not in (None, "auto"):
            raise HpcparError(f"generate.resume must be 'auto' or absent, got {resume!r}")
        if resume and self.partial.exists():
            check_partial(self.partial, shape)
            self._write(lambda: self._open("r+"))
        else:
            self._write(self._create)
        if lines is not None and not self.failed:
            self.mirror = (self.results(), self.done)
            self._write(lambda: (lines.start(), self._extend_lines()))
        if self.failed:
            raise self.failed

    def _extend_lines(self) -> None:
        self.lines.extend(*self.mirror, self.shape.prompt_lengths)

    def _open(self, mode: str) -> None:
        self.file = h5py.File(self.partial, mode)

    def _create(self) -> None:
        check_space(self.partial, self.shape.nbytes)
        self._open("w")
        f, n = self.file, self.shape.count
        f.attrs["run"] = json.dumps(self.shape.run, sort_keys=True)
        # written out now, so that marking rows done later only overwrites bytes in place
        for name, values in RowResults.empty(n, self.shape.results).arrays.items():
            f.create_dataset(name, data=values)
        f.create_dataset("prompt_lengths", data=np.asarray(self.shape.prompt_lengths,
                                                           np.int64))
        f.create_dataset("done", data=~self.shape.present)      # a row past a prompt's n
        if self.shape.save_logits:
            # every chunk allocated (and filled with NaN) now: a disk too small fails here,
            # before any work, rather than when a wave's logits arrive
            longest = int(max(self.shape.prompt_lengths))
            early = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            early.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            f.create_dataset("prompt_logits", (self.shape.prompts, longest, self.shape.vocab),
                             dtype=np.float32,
                             chunks=(1, longest, self.shape.vocab), fillvalue=np.nan,
                             dcpl=early)
        write_point(self.partial)
        f.flush()
        reserve(self.partial)        # rows later overwrite bytes in place: no new blocks

    def _write(self, work) -> None:
        """Run ``work`` (it writes the file); a failure is kept in ``failed``, and the file
        is closed and kept only if it can still be resumed."""
        if self.failed:
            return
        try:
            with writing(self.partial):
                work()
        except WriteError as e:
            self.failed = WriteError(f"{e}; {self._salvage()}")

    def _salvage(self) -> str:
        if self.lines is not None:          # written again from the partial file on resume
            self.lines.discard()
        if self.file is not None:
            with quiet_deallocation():
                try:
                    self.file.close()
                except Exception:   # the close flushes, and may fail as the write did
                    pass
            self.file = None
        try:
            check_partial(self.partial, self.shape)
            with h5py.File(self.partial, "r") as f:
                finished = int(f["done"][()].sum())
        except (HpcparError, OSError):
            self.partial.unlink(missing_ok=True)
            return "no finished prompt could be kept"
        if not finished:
            self.partial.unlink(missing_ok=True)
            return "no prompt had finished"
        return (f"the {finished} finished prompts are kept in {self.partial}: make room, then "
                "run again with --resume auto")

    @property
    def done(self) -> np.ndarray:
        return self.file["done"][()]

    def finish_rows(self, rows: np.ndarray, results: RowResults) -> None:
        """Finished prompts (global indices) and their results. Their results reach the disk
        before they are marked done, so a process killed in between loses the mark, not
        the results behind it."""
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows)
        rows, results = list(rows[order]), results.take(order)

        def work():
            f = self.file
            for name, values in results.arrays.items():
                if values.size:     # an empty one (K 0: [rows, tokens, 0]) has nothing to
                    f[name][rows] = values      # write, and h5py refuses its selection
            write_point(self.partial)
            f.flush()
            f["done"][rows] = True
            f.flush()
            if self.mirror is not None:
                mirror, done = self.mirror
                mirror.put(rows, results)
                done[rows] = True
                self._extend_lines()

        self._write(work)

    def write_logits(self, mb, full: np.ndarray) -> None:
        """A micro-batch's prompt logits (``unpad_into``)."""
        width = 1 if self.shape.samples is None else self.shape.samples.width
        self._write(lambda: unpad_into(self.file["prompt_logits"], mb, full, width))

    def results(self) -> RowResults:
        """Every prompt's results, this run's and the earlier runs' alike."""
        return RowResults(self.shape.results, {name: self.file[name][()]
                                               for name in self.shape.results.specs()})

    def complete(self, attrs: dict, texts: list[str] | None, reasons: list[str]) -> None:
        """Add the text, each row's finish reason and the run's attributes, then rename the
        file into place. What needs room is written first, while the file can still be
        resumed."""
        def fill():
            f = self.file
            for name in ("text", "finish_reason"):   # a partial file from before they came last
                if name in f:
                    del f[name]
            samples = self.shape.samples
            width = 1 if samples is None else samples.width
            if texts is not None:
                stored, replaced = hdf5_texts(texts)
                f.create_dataset("text", data=by_prompt(np.array(stored, object), width),
                                 dtype=h5py.string_dtype("utf-8"))
                if replaced:
                    f["text"].attrs["nul_replaced"] = replaced
            f.create_dataset("finish_reason", data=by_prompt(np.array(reasons, object), width),
                             dtype=h5py.string_dtype("utf-8"))
            if width > 1:
                regroup(f, self.shape.results, samples)
            for key, value in (attrs | {OUTPUT_KIND: "generation"}).items():
                f.attrs[key] = value
            write_point(self.partial)
            f.flush()

        def seal():
            f = self.file
            del f["done"]
            del f.attrs["run"]
            f.close()
            self.file = None
            os.replace(self.partial, self.path)

        if self.lines is not None:
            self._write(self._extend_lines)
            self._write(self._seal_lines)
        else:
            if texts is not None:
                self._write(lambda: check_space(self.partial, sum(len(t.encode()) + 16
                                                                  for t in texts)))
            self._write(fill)
            self._write(seal)
        if self.failed:
            raise self.failed

    def _seal_lines(self) -> None:
        """The JSON lines into place; the partial file, their record, is then done with."""
        self.lines.commit()
        self.file.close()
        self.file = None
        self.partial.unlink()
