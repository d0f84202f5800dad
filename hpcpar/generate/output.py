"""The output file of a generation job, written by rank 0 as the job goes and renamed into
place when complete.

    tokens         int64 [batch, max_new_tokens]   new tokens only; pad id after a row's EOS
    lengths        int64 [batch]                   new tokens up to and including EOS
    prompt_lengths int64 [batch]
    prompt_logits  float32 [batch, seq, vocab]     with --save-logits: position t of prompt b
                                                   at [b, t], NaN past the prompt's end
    text           utf-8 [batch]                   decoded new tokens, when there is a tokenizer
    attributes     the run's settings and its report
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from ..errors import HpcparError
from ..outputs import remove_stale_temporaries



def unpad_into(logits, mb, full: np.ndarray) -> None:
    """A micro-batch's logits (b, L, vocab) into ``logits`` (an array or an HDF5 dataset of
    [batch, seq, vocab]), position t of each prompt at t, its padding left out."""
    for j, row in enumerate(mb.rows):
        logits[row, :mb.lengths[j]] = full[j, :mb.lengths[j]]


class PartialOutput:
    """The output file while a generation runs (rank 0 only): a hidden sibling
    ``.NAME.partial`` that holds every dataset from the start, receives the finished
    prompts' tokens and lengths as they come (``generate.stream``) and each micro-batch's
    prompt logits as they are ready, and records which prompts are done and the run's
    settings; the text is decoded at the end. ``complete`` renames it into place; a run
    stopped early leaves it for ``resume="auto"``, which keeps the prompts it finished. The
    output path itself only ever holds a complete file."""

    def __init__(self, path: str | Path, count: int, max_new_tokens: int, prompts, vocab: int,
                 save_logits: bool, fingerprint: str, resume: str | None):
        self.path = Path(path)
        self.partial = self.path.with_name(f".{self.path.name}.partial")
        remove_stale_temporaries(self.path)
        if resume not in (None, "auto"):
            raise HpcparError(f"generate.resume must be 'auto' or absent, got {resume!r}")
        if resume and self.partial.exists():
            try:
                self.file = h5py.File(self.partial, "r+")
            except OSError as e:
                raise HpcparError(f"{self.partial}: cannot resume from it ({e}); remove it to "
                                  "start over") from None
            if self.file.attrs.get("run") != fingerprint:
                self.file.close()
                raise HpcparError(f"{self.partial}: a stopped run with other settings (model, "
                                  "prompts, sampling, wave size); run it with those, or "
                                  f"remove {self.partial} to start over")
        else:
            self.file = h5py.File(self.partial, "w")
            f = self.file
            f.attrs["run"] = fingerprint
            # written out now, so that marking rows done later only overwrites bytes in place
            f.create_dataset("tokens", data=np.zeros((count, max_new_tokens), np.int64))
            f.create_dataset("lengths", data=np.zeros(count, np.int64))
            f.create_dataset("prompt_lengths", data=np.asarray(prompts.lengths, np.int64))
            f.create_dataset("done", data=np.zeros(count, bool))
            if save_logits:
                longest = max(prompts.lengths)
                f.create_dataset("prompt_logits", (count, longest, vocab), dtype=np.float32,
                                 chunks=(1, longest, vocab), fillvalue=np.nan)
            f.flush()

    @property
    def done(self) -> np.ndarray:
        return self.file["done"][()]

    @property
    def logits(self):
        """The prompt_logits dataset, written one micro-batch at a time (``unpad_into``)."""
        return self.file["prompt_logits"]

    def finish_rows(self, rows: np.ndarray, tokens, lengths) -> None:
        """Finished prompts (global indices) and their results. Their tokens reach the disk
        before they are marked done, so a process killed in between loses the mark, not
        the tokens behind it."""
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows)
        rows, f = list(rows[order]), self.file
        f["tokens"][rows] = np.asarray(tokens)[order]
        f["lengths"][rows] = np.asarray(lengths)[order]
        f.flush()
        f["done"][rows] = True
        f.flush()

    def results(self) -> tuple[np.ndarray, np.ndarray]:
        """Every prompt's tokens and lengths, this run's and the earlier runs' alike."""
        return self.file["tokens"][()], self.file["lengths"][()]

    def complete(self, attrs: dict, texts: list[str] | None) -> None:
        f = self.file
        if "text" in f:                     # a partial file from before text came last
            del f["text"]
        if texts is not None:
            f.create_dataset("text", data=texts, dtype=h5py.string_dtype("utf-8"))
        for key, value in attrs.items():
            f.attrs[key] = value
        del f["done"]
        del f.attrs["run"]
        f.close()
        os.replace(self.partial, self.path)
