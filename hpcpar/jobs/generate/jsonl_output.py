"""A generation's results as JSON lines (``--out NAME.jsonl``), written as the finished
prompts form a longer prefix; the partial HDF5 file (``generate.output_file``) stays the
resumable record, from which a resumed run writes them again. ``batch_api.BatchLines`` writes
a Batch API file's output lines the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ...checkpoint.files import JSONL_KEYS, write_point
from .results import RowResults, Samples


class JsonLines:
    """A generation's results as JSON lines (``--out NAME.jsonl``), one per prompt in input
    order: its index, text, token ids, finish reason and token counts. Lines are appended to
    a hidden ``.NAME.jsonl.lines`` as the finished prompts form a longer prefix, and renamed
    into place at the end. The partial HDF5 file stays the resumable record: a resumed run
    writes the lines again from it."""

    def __init__(self, path: Path, describe, more=None, samples: Samples | None = None):
        """``describe(row, tokens_row, length)``: the row's text (None without a
        tokenizer) and why it ended; ``more(row, results)``: the line's other fields
        (its log-probabilities); ``samples``: the rows' prompts, when a prompt has several
        (each line then names its ``sample`` after its prompt's ``index``)."""
        self.path = path
        self.tmp = path.with_name(f".{path.name}.lines")
        self.describe, self.more, self.samples = describe, more, samples
        self.written = 0
        self.file = None

    def start(self) -> None:
        self.file = open(self.tmp, "w", encoding="utf-8")
        self.written = 0

    def extend(self, results: RowResults, done: np.ndarray, prompt_lengths: np.ndarray) -> None:
        """Write the lines of the finished prompts that now follow the written ones."""
        end = self.written
        while end < len(done) and done[end]:
            end += 1
        tokens, lengths = results.tokens, results.lengths
        samples = self.samples
        for r in range(self.written, end):
            prompt, sample = (r, 0) if samples is None else samples.prompt_of(r)
            if sample >= (1 if samples is None else samples.counts[prompt]):
                continue                                 # past the prompt's own n
            text, reason = self.describe(r, tokens[r], lengths[r])
            line = dict(zip(JSONL_KEYS, (prompt, text, tokens[r, :lengths[r]].tolist(),
                                         reason, int(prompt_lengths[r]), int(lengths[r]))))
            if samples is not None and samples.width > 1:
                line = {"index": prompt, "sample": sample} | line
            if self.more is not None:
                line |= self.more(r, results)
            self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        if end > self.written:
            self.flush()
            self.written = end

    def flush(self) -> None:
        write_point(self.tmp)
        self.file.flush()

    def commit(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if self.file is not None and not self.file.closed:
            try:
                self.file.close()
            except OSError:
                pass
        self.tmp.unlink(missing_ok=True)
