"""The output file of a generation job, written atomically by rank 0.

    tokens         int64 [batch, max_new_tokens]   new tokens only; pad id after a row's EOS
    lengths        int64 [batch]                   new tokens up to and including EOS
    prompt_lengths int64 [batch]
    prompt_logits  float32 [batch, seq, vocab]     with --save-logits: position t of prompt b
                                                   at [b, t], NaN past the prompt's end
    text           utf-8 [batch]                   decoded new tokens, when there is a tokenizer
    attributes     the run's settings and its report
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from ..checkpoint import AtomicPath


def write_output(path: str | Path, tokens: np.ndarray, lengths: np.ndarray,
                 prompt_lengths: np.ndarray, prompt_logits: np.ndarray | None,
                 texts: list[str] | None, attrs: dict) -> None:
    out = AtomicPath(path)
    try:
        with h5py.File(out.tmp, "w") as f:
            f.create_dataset("tokens", data=tokens)
            f.create_dataset("lengths", data=lengths)
            f.create_dataset("prompt_lengths", data=prompt_lengths)
            if prompt_logits is not None:
                f.create_dataset("prompt_logits", data=prompt_logits)
            if texts is not None:
                f.create_dataset("text", data=texts, dtype=h5py.string_dtype("utf-8"))
            for key, value in attrs.items():
                f.attrs[key] = value
        out.commit()
    except BaseException:
        out.discard()
        raise
