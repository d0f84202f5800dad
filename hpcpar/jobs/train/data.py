"""Training data: token sequences and the order the steps read them in (docs/design.md §3).

A dataset is a list of samples of L + 1 tokens each (inputs ``row[:-1]``, labels ``row[1:]``):

- ``.npy`` of int ids ``[rows, L + 1]``, one sample per row; negative ids at the start of a
  row are left padding (its labels are ignored, and so is the label of the first real token,
  which has no context);
- ``.bin``, a flat token file (uint16 when the vocabulary fits, else uint32): sample i is
  tokens ``[i L, i L + L + 1)`` with ``--seq-len L``;
- ``.jsonl`` of ``{"ids": [...]}`` or ``{"text": "..."}`` lines, tokenized, joined (EOS
  between documents when the model has one) and cut like a ``.bin``;
- ``.jsonl`` of fine-tuning rows (``{"messages"}``, ``{"prompt", "completion"}`` or ``{"ids",
  "labels"}``, ``chat_data``): one sample per row, left-padded, with the labels that carry
  the loss beside it (``Dataset.labels``);
- ``synthetic``: generated sequences a model can learn (each token is followed by a fixed
  successor 90% of the time), for demos and benchmarks without data files.

With ``pack`` (``--pack``) the samples are packed several to a row of ``seq_len`` positions
(``packing``): the fine-tuning rows, the ``.jsonl`` documents (a line and its EOS), the
``.bin``'s documents (cut after each EOS) or the ``.npy``'s rows (left padding dropped), each
a document of its own; ``Dataset.documents`` says where each position's document begins.

Order: step s (1-based) reads global samples (s-1) B .. s B - 1, wrapping around the dataset;
with ``shuffle`` each epoch is a permutation drawn from a generator keyed by (seed, epoch).
The position is a global sample index, so it survives any change of dp or micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...models.config import ModelConfig
from ...parallel.context_parallel.ring_attention import ContextShard
from ...parallel.errors import HpcparError
from ...parallel.mesh import Mesh
from ..inputs.prompts import read_records
from ..npy import read_npy
from ...parallel.ops.attention import Documents
from .chat_data import fine_tuning_rows, is_fine_tuning
from .model_chunk import Batch
from .packing import documents_of, fit_documents, pack, row_samples


class DataError(HpcparError):
    pass


@dataclass
class Dataset:
    samples: np.ndarray          # (n, L + 1) int64 (or a memmap view cut into windows)
    source: str
    labels: np.ndarray | None = None    # (n, L + 1) aligned with samples, -1: no loss (None:
                                        # every next token, padding aside)
    note: str = ""               # what reading it found, for the report (fine-tuning rows)
    documents: np.ndarray | None = None   # packed rows: (n, L) int32 where each position's
                                          # document begins, real inputs first (``packing``)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def seq_len(self) -> int:
        """Input positions per sample (L)."""
        return self.samples.shape[1] - 1


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype of a ``.bin`` token file for this vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _windows(tokens: np.ndarray, seq_len: int, source: str) -> np.ndarray:
    """Samples i = tokens[i L, i L + L + 1) as a strided view (no copy of a memmap)."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise DataError(f"{source}: {len(tokens)} tokens do not fill one sample of "
                        f"seq_len {seq_len} + 1")
    stride = tokens.strides[0]
    return np.lib.stride_tricks.as_strided(tokens, (n, seq_len + 1), (seq_len * stride, stride),
                                           writeable=False)


SYNTHETIC = "synthetic"
SYNTHETIC_ROWS = 4096


def synthetic_samples(vocab_size: int, seq_len: int, rows: int = SYNTHETIC_ROWS,
                      seed: int = 0) -> np.ndarray:
    """Sequences where token t is followed by successor[t] with probability 0.9 and by a
    uniform random token otherwise: a loss that falls from log(vocab) towards ~0.5 nats."""
    rng = np.random.default_rng([seed, 1])
    successor = rng.permutation(vocab_size)
    out = np.empty((rows, seq_len + 1), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab_size, rows)
    for t in range(1, seq_len + 1):
        noise = rng.random(rows) < 0.1
        out[:, t] = np.where(noise, rng.integers(0, vocab_size, rows), successor[out[:, t - 1]])
    return out


def load_dataset(path: str | Path, cfg: ModelConfig, seq_len: int | None = None,
                 tokenizer=None, chat=None, long_rows: str = "refuse",
                 pack: bool = False) -> Dataset:
    """Read and check a dataset; every problem is a one-line ``DataError``. ``chat``: the
    checkpoint's ``ChatTemplate`` (None: it has none), for conversations; ``long_rows``:
    what a fine-tuning row (or with ``pack`` a sample) longer than ``seq_len + 1`` tokens
    meets ("refuse" or "cut"); ``pack``: samples packed several to a row."""
    if pack:
        return packed_dataset(path, cfg, seq_len, tokenizer, chat, long_rows)
    if str(path) == SYNTHETIC:
        check_positions(seq_len or 64, cfg, SYNTHETIC)
        return Dataset(synthetic_samples(cfg.vocab_size, seq_len or 64), SYNTHETIC)
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file (.npy rows, .bin tokens or .jsonl)")
    suffix = path.suffix
    if suffix == ".npy":
        rows = read_npy(path, "the rows' token ids (int, [rows, L + 1])", DataError)
        if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
            raise DataError(f"{path}: expected int token ids of shape [rows, L + 1], got "
                            f"{rows.dtype} {rows.shape}")
        samples = rows.astype(np.int64, copy=False)
    elif suffix == ".jsonl" and is_fine_tuning(records := read_records(path)):
        rows = fine_tuning_rows(path, records, cfg, seq_len, long_rows, tokenizer, chat)
        check_positions(rows.samples.shape[1] - 1, cfg, str(path))
        check_samples(rows.samples, cfg, str(path))
        return Dataset(rows.samples, str(path), rows.labels, rows.describe(str(path)))
    elif suffix in (".bin", ".jsonl"):
        if not seq_len:
            raise DataError(f"{path}: a {suffix} dataset needs --seq-len (tokens per sample)")
        if suffix == ".bin":
            tokens = _token_file(path, token_dtype(cfg.vocab_size))
        else:
            tokens = _jsonl_tokens(path, cfg, tokenizer)
        samples = _windows(tokens, seq_len, str(path))
    else:
        raise DataError(f"{path}: unknown data format {suffix!r}; use .npy, .bin or .jsonl")
    if seq_len and samples.shape[1] != seq_len + 1:
        raise DataError(f"{path}: rows hold {samples.shape[1]} tokens, --seq-len {seq_len} "
                        f"needs {seq_len + 1}")
    check_positions(samples.shape[1] - 1, cfg, str(path))
    check_samples(samples, cfg, str(path))
    return Dataset(samples, str(path))


def _token_file(path: Path, dtype: np.dtype) -> np.ndarray:
    """A ``.bin`` token file as a read-only memmap, its size checked first."""
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens "
                        f"({dtype.itemsize} bytes each, as this vocabulary needs); the file is "
                        "truncated or was written for another vocabulary" if size else
                        f"{path}: the token file is empty")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    head = np.asarray(tokens[:1 << 20])
    if dtype == np.uint16 and head.size >= 64 and head.size % 2 == 0 and \
            not head[1::2].any() and head[0::2].any():
        raise DataError(f"{path}: every other uint16 token is 0, as uint32 (or int32) tokens "
                        f"read as uint16 are; a vocabulary of at most 65,536 takes uint16 "
                        f"tokens: write them as tokens.astype(np.uint16).tofile(path)")
    return tokens


def check_positions(seq_len: int, cfg: ModelConfig, source: str) -> None:
    """A sample's inputs fit the model's positions, as a generated sequence must."""
    positions, field = cfg.positions
    if seq_len > positions:
        raise DataError(f"{source}: samples of {seq_len} input tokens exceed the model's "
                        f"{field}; lower --seq-len to at most {positions}")


def _jsonl_tokens(path: Path, cfg: ModelConfig, tokenizer) -> np.ndarray:
    """Every line's ids (or its text through the tokenizer) joined, EOS after each."""
    return np.concatenate(_jsonl_documents(path, cfg, tokenizer))


def _jsonl_documents(path: Path, cfg: ModelConfig, tokenizer) -> list[np.ndarray]:
    """Every line's ids (or its text through the tokenizer), EOS after each."""
    from ..inputs.prompts import load_prompts  # the same {"ids"} / {"text"} lines
    eos = np.asarray(cfg.eos_token_id[:1], dtype=np.int64)
    return [np.concatenate([np.asarray(doc, np.int64), eos])
            for doc in load_prompts(str(path), tokenizer).ids]


def packed_dataset(path, cfg: ModelConfig, seq_len: int | None, tokenizer, chat,
                   long_rows: str) -> Dataset:
    """The samples of ``path`` packed into rows of ``seq_len`` positions (``packing``)."""
    if str(path) == SYNTHETIC:
        raise DataError("--pack: synthetic data has no samples of its own to pack (each is a "
                        "whole row); pack a .jsonl, .bin or .npy file, or drop --pack")
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file (.npy rows, .bin tokens or .jsonl)")
    if not seq_len:
        raise DataError(f"{path}: --pack needs --seq-len (the positions of a row the samples "
                        "are packed into)")
    check_positions(seq_len, cfg, str(path))
    if path.suffix == ".jsonl" and is_fine_tuning(records := read_records(path)):
        rows = fine_tuning_rows(path, records, cfg, seq_len, long_rows, tokenizer, chat)
        samples, note = row_samples(rows.samples, rows.labels), rows.describe(str(path))
    else:
        docs, names = _documents(path, cfg, tokenizer)
        samples, cut, skipped = fit_documents(docs, names, seq_len, long_rows)
        if not samples:
            raise DataError(f"{path}: no document has 2 tokens or more (an input and its "
                            "label); nothing to pack")
        note = _documents_note(str(path), samples, cut, skipped)
    packed = pack(samples, seq_len)
    check_samples(packed.samples, cfg, str(path))
    return Dataset(packed.samples, str(path), packed.labels, f"{note}; {packed.describe()}",
                   packed.starts)


def _documents(path: Path, cfg: ModelConfig, tokenizer) -> tuple[list[np.ndarray], list[str]]:
    """The documents of a ``.jsonl`` (a line each), ``.bin`` (cut after each EOS) or ``.npy``
    (a row each), and the name each goes by in a message."""
    if path.suffix == ".jsonl":
        docs = _jsonl_documents(path, cfg, tokenizer)
        lines = [n for n, _ in read_records(path)]
        names = [f"{path}:{n}" for n in lines] if len(lines) == len(docs) else \
            [f"{path}: document {k + 1}" for k in range(len(docs))]
        return docs, names
    if path.suffix == ".bin":
        if not cfg.eos_token_id:
            raise DataError(f"{path}: --pack cuts a token file into documents after each EOS, "
                            "and this model has no eos_token_id; pack a .jsonl of documents")
        docs = documents_of(np.asarray(_token_file(path, token_dtype(cfg.vocab_size))),
                            cfg.eos_token_id[0])
        at = np.cumsum([0] + [len(d) for d in docs])
        return docs, [f"{path}: document {k + 1} (from token {at[k]:,})"
                      for k in range(len(docs))]
    if path.suffix == ".npy":
        rows = read_npy(path, "the rows' token ids (int, [rows, L + 1])", DataError)
        if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer):
            raise DataError(f"{path}: expected int token ids of shape [rows, L + 1], got "
                            f"{rows.dtype} {rows.shape}")
        check_samples(rows.astype(np.int64, copy=False), cfg, str(path))
        return ([ids for ids, _ in row_samples(rows, None)],
                [f"{path}: row {r}" for r in range(len(rows))])
    raise DataError(f"{path}: unknown data format {path.suffix!r}; use .npy, .bin or .jsonl")


def _documents_note(source: str, samples, cut: int, skipped: int) -> str:
    tokens = sum(len(ids) - 1 for ids, _ in samples)
    text = f"{source}: {len(samples):,} documents, {tokens:,} tokens carrying the loss"
    if cut:
        text += f"; {cut:,} cut to the row's length"
    if skipped:
        text += f"; {skipped:,} of one token skipped"
    return text


def check_samples(samples: np.ndarray, cfg: ModelConfig, source: str,
                  block_rows: int = 1 << 16) -> None:
    """Every id below the vocabulary, padding only at the start of a row, and at least two
    real tokens per sample. Reads the data in blocks of rows (a token file may be larger
    than memory)."""
    if len(samples) == 0:
        raise DataError(f"{source}: the dataset holds no samples")
    if samples.shape[1] < 2:
        raise DataError(f"{source}: samples of {samples.shape[1]} token(s); training needs at "
                        "least 2 (an input and its next-token label)")
    signed = np.issubdtype(samples.dtype, np.signedinteger)
    for first in range(0, len(samples), block_rows):
        block = np.asarray(samples[first:first + block_rows])
        top = int(block.max())
        if top >= cfg.vocab_size:
            where = np.argwhere(block >= cfg.vocab_size)[0]
            raise DataError(f"{source}: token id {top} >= vocab_size {cfg.vocab_size} (first "
                            f"at sample {first + where[0]}, position {where[1]})")
        if not signed:
            continue                                   # token files hold no padding
        pad = pad_lengths(block)
        inner = (block >= 0).sum(axis=1) != block.shape[1] - pad
        if inner.any():
            raise DataError(f"{source}: sample {first + int(np.argmax(inner))} has padding "
                            "(negative ids) after a real token; only left padding is allowed")
        short = block.shape[1] - pad < 2
        if short.any():
            raise DataError(f"{source}: sample {first + int(np.argmax(short))} has fewer than 2 "
                            "real tokens; training needs an input and a label")


def pad_lengths(samples: np.ndarray) -> np.ndarray:
    """Leading negative ids per row."""
    real = samples >= 0
    return np.where(real.any(axis=1), real.argmax(axis=1), samples.shape[1]).astype(np.int64)


def sample_indices(first: int, count: int, num_samples: int, shuffle: bool,
                   seed: int) -> np.ndarray:
    """The dataset rows of global samples first .. first + count - 1 (step s of batch B
    reads first = (s - 1) B)."""
    g = np.arange(first, first + count, dtype=np.int64)
    if not shuffle:
        return g % num_samples
    epochs, within = np.divmod(g, num_samples)
    out = np.empty_like(g)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_samples)
        pick = epochs == epoch
        out[pick] = perm[within[pick]]
    return out


def step_fill(dataset: Dataset, first_sample: int, train) -> float | None:
    """Packed rows: the share of the positions of the step's rows (those ``replica_batches``
    reads from ``first_sample``) that hold a sample's input; None for rows not packed."""
    if dataset.documents is None:
        return None
    picked = sample_indices(first_sample, train.global_batch, len(dataset), train.shuffle,
                            train.seed)
    return float((dataset.samples[picked][:, :-1] >= 0).mean())


@dataclass
class HostBatch:
    """One micro-batch on the host (see ``chunk.Batch`` for the meaning of the fields)."""

    ids: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    weights: np.ndarray
    documents: np.ndarray | None = None     # packed rows: (B, T) document starts


def label_count(samples: np.ndarray, labels: np.ndarray | None = None) -> int:
    """How many labels count in the loss: per row, L + 1 - pad - 1 (the first real token
    has no label); with ``labels`` (aligned with the samples), those of them >= 0 after each
    row's first token."""
    if labels is not None:
        return int((labels[:, 1:] >= 0).sum())
    return int((samples.shape[1] - 1 - pad_lengths(samples)).sum())


def make_batches(samples: np.ndarray, num_micro_batches: int, total_labels: int,
                 dtype, labels: np.ndarray | None = None,
                 documents: np.ndarray | None = None) -> list[HostBatch]:
    """Split a replica's samples into micro-batches of inputs, labels and loss weights
    (``labels``: aligned with the samples, -1 where no loss; else each next token;
    ``documents``: packed rows' document starts, already in the batch's layout).

    A sample's left padding (negative ids) moves to its end: each row's real tokens come
    first, the layout attention takes (per-row lengths). Positions restart at 0 on the first
    real token either way, so the loss and every gradient are the same."""
    out = []
    parts = np.array_split(np.arange(len(samples)), num_micro_batches)
    for rows in parts:
        part = samples[rows]
        targets = part if labels is None else labels[rows]
        pad = pad_lengths(part)
        B, T = part.shape[0], part.shape[1] - 1
        lengths = T - pad                                           # real inputs per row
        inputs = np.zeros((B, T), dtype=np.int64)
        labels_mb = np.full((B, T), -1, dtype=np.int64)
        for j in range(B):
            inputs[j, :lengths[j]] = part[j, pad[j]:-1]
            labels_mb[j, :lengths[j]] = targets[j, pad[j] + 1:]
        labels_mb = labels_mb.reshape(-1)
        weights = np.where(labels_mb < 0, 0.0, 1.0 / total_labels).astype(dtype)
        out.append(HostBatch(inputs, lengths, labels_mb, weights,
                             None if documents is None else documents[rows]))
    return out


def replica_batches(dataset: Dataset, mesh: Mesh, micro_batches: int, first_sample: int,
                    train, xp, loss_scale: float = 1.0) -> tuple[list[Batch], int]:
    """This replica's ``micro_batches`` of the global batch (``train.global_batch`` samples,
    ``train.shuffle``d by ``train.seed``) starting at ``first_sample``, each label weighted
    by loss_scale / (labels in the whole global batch: the loss is their mean, whatever the
    layout), and that count; under context parallelism, this rank's positions of each
    row."""
    B, dp, d = train.global_batch, mesh.size("dp"), mesh.coord("dp")
    picked = sample_indices(first_sample, B, len(dataset), train.shuffle, train.seed)
    rows = np.asarray(dataset.samples[picked], np.int64)
    targets = None if dataset.labels is None else dataset.labels[picked]
    docs = None if dataset.documents is None else dataset.documents[picked]
    total = label_count(rows, targets)
    mine = slice(d * B // dp, (d + 1) * B // dp)
    batches = []
    for b in make_batches(rows[mine], micro_batches, total, np.float32,
                          None if targets is None else targets[mine],
                          None if docs is None else docs[mine]):
        ids, labels, weights = b.ids, b.labels, b.weights * np.float32(loss_scale)
        shard = context_shard(ids.shape[1], mesh) if mesh.size("cp") > 1 else None
        if shard is not None:
            rows_of = ids.shape
            ids, labels, weights = (shard.take(a.reshape(rows_of)) for a in (ids, labels, weights))
            labels, weights = labels.reshape(-1), weights.reshape(-1)
        documents = None if b.documents is None else Documents.build(xp, b.documents)
        batches.append(Batch(xp.asarray(ids), xp.asarray(b.lengths.astype(np.int32)),
                             xp.asarray(labels), xp.asarray(weights), shard, documents))
    return batches, total


def context_shard(length: int, mesh: Mesh) -> ContextShard:
    """This rank's part of sequences of ``length`` positions."""
    return ContextShard(length, mesh.size("cp"), mesh.coord("cp"))
