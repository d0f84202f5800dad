"""Opening, validating and loading checkpoints: each rank reads only its own slices.

``open_checkpoint`` checks everything that can be checked from metadata (HDF5 signature,
format version, config, every tensor's presence, shape and dtype) and raises one
``CheckpointError`` naming the file and the tensor. ``load_shard`` then reads, for one rank,
only the tensors of its pipeline stage and only its tensor-parallel slice of each, with
hyperslab reads straight into preallocated buffers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

import h5py
import numpy as np

from ..models.config import ConfigError, ModelConfig
from ..models.sharding import piece_of
from ..models.tensors import TensorSpec, stored_tensors
from ..parallel.device.backend import NUMPY, ArrayBackend
from ..parallel.device.dtypes import FLOAT_DTYPES, any_nonfinite, dtype_name, nonfinite
from ..parallel.errors import HpcparError
from ..parallel.tensor_parallel.layers import stored_matrix
from .parts import check_parts
from .format import (ATTR_CONFIG, ATTR_VERSION, FORMAT_VERSION, INERT_GROUP, TOKENIZER_GROUP,
                     logical_dtype, storage_dtype)


class CheckpointError(HpcparError):
    pass


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint's metadata (the file itself is reopened for each read)."""

    path: Path
    config: ModelConfig
    hf_config: dict
    dtype: np.dtype                      # the dtype its tensors are stored in
    version: int
    tensors: dict[str, TensorSpec]

    def open(self) -> h5py.File:
        # No HDF5 file locking: many ranks read at once, often from NFS or Lustre.
        return h5py.File(self.path, "r", locking=False)

    def inert_tensors(self) -> dict[str, np.ndarray]:
        """The source's tensors that compute nothing, kept for export (``INERT_GROUP``)."""
        with self.open() as f:
            group = f.get(INERT_GROUP)
            return {} if group is None else {k: np.asarray(group[k][()]) for k in group}

    def tokenizer_files(self) -> dict[str, bytes]:
        """The files kept at conversion beside the weights (tokenizer.json, the chat template,
        ...), by name, as raw bytes: whoever needs one checks its content, so a damaged one
        fails only the jobs that read it."""
        with self.open() as f:
            group = f.get(TOKENIZER_GROUP)
            if group is None:
                return {}
            try:
                return {k: np.asarray(group[k][()]).tobytes() for k in group}
            except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:
                raise CheckpointError(f"{self.path}: its stored tokenizer files cannot be read "
                                      f"({_first_line(e)}); convert the model again") from None


def _training_run_hint(path: Path) -> str | None:
    """What to pass instead of a training run's folder or its ``latest`` file (which holds
    the name of the run's newest checkpoint, ``step-N.h5``), or None for any other path."""
    pointer = path / "latest" if path.is_dir() else path
    try:
        name = pointer.read_text().strip() if pointer.name == "latest" and (
            pointer.is_file() and pointer.stat().st_size < 256) else ""
    except (OSError, UnicodeDecodeError):
        return None
    if not re.fullmatch(r"step-\d+\.h5", name):
        return None
    newest = pointer.parent / name
    if path.is_dir():
        return (f"{path}: a training run's folder, not a checkpoint file; its newest "
                f"checkpoint is {newest} (named by {pointer}): pass that")
    return (f"{path}: a training run's pointer, not a checkpoint: it holds the name of the "
            f"run's newest checkpoint, {name}; pass {newest}")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Validate ``path`` and return its metadata; every problem is a one-line error."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file; create one with 'hpcpar convert' or "
                              "'hpcpar init'")
    run_hint = _training_run_hint(path)
    if run_hint:
        raise CheckpointError(run_hint)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a folder, not a checkpoint file; a Hugging Face "
                              "folder must first go through 'hpcpar convert'")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"{path}: not an HDF5 file; create checkpoints with "
                              "'hpcpar convert' or 'hpcpar init'")
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened, the file is truncated or corrupt "
                              f"({_first_line(e)}); convert or copy it again") from None
    with f:
        version = f.attrs.get(ATTR_VERSION)
        if version is None:
            raise CheckpointError(f"{path}: no '{ATTR_VERSION}' attribute; not an hpcpar "
                                  "checkpoint")
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: its '{ATTR_VERSION}' attribute {version!r} is not "
                                  "a version number; not an hpcpar checkpoint") from None
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{path}: format version {version} is newer than this "
                                  f"hpcpar reads ({FORMAT_VERSION}); upgrade hpcpar")
        try:
            hf_config = json.loads(f.attrs[ATTR_CONFIG])
            config = ModelConfig.from_hf(hf_config, source=f"{path} config")
        except KeyError:
            raise CheckpointError(f"{path}: no '{ATTR_CONFIG}' attribute") from None
        except (ValueError, TypeError) as e:            # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"{path}: unreadable '{ATTR_CONFIG}' attribute "
                                  f"({_first_line(e)})") from None
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        missing_part = check_parts(path, f)     # a checkpoint every rank wrote a part of
        if missing_part:
            raise CheckpointError(missing_part)
        specs = {s.name: s for s in stored_tensors(config)}
        dtypes = set()
        for name, spec in specs.items():
            dset = f.get(name)
            if not isinstance(dset, h5py.Dataset):
                train = f.get("train")                      # a LoRA run's: no base
                if isinstance(train, h5py.Group) and "lora_rank" in train.attrs:
                    raise CheckpointError(
                        f"{path}: a LoRA run's checkpoint, which holds its adapter only; give "
                        "the base model as the checkpoint and this as --lora, or export it "
                        "with --lora or --merge-lora")
                raise CheckpointError(f"{path}: tensor {name} is missing")
            if dset.shape != spec.shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {dset.shape}, the "
                                      f"config implies {spec.shape}")
            dtype = logical_dtype(dset)
            if dtype not in FLOAT_DTYPES.values():
                raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, expected one "
                                      f"of {', '.join(FLOAT_DTYPES)}")
            dtypes.add(dtype)
        # a weight the config has no place for (a bias with attention_bias off) would be
        # left out of every product without a word
        extra = sorted(n for n, item in f.items()
                       if isinstance(item, h5py.Dataset) and n not in specs)
        if extra:
            raise CheckpointError(
                f"{path}: tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1
                                                else "") + " is not one of the model its "
                "config describes, which would leave it unused; convert the model again, or "
                "fix the config")
    if len(dtypes) != 1:
        raise CheckpointError(f"{path}: tensors mix dtypes "
                              f"{sorted(dtype_name(d) for d in dtypes)}")
    return Checkpoint(path, config, hf_config, dtypes.pop(), int(version), specs)


@dataclass
class LoadedShard:
    """One rank's tensors and what it cost to read them."""

    tensors: dict[str, object] = field(default_factory=dict)   # name -> xp array
    bytes_read: int = 0
    seconds: float = 0.0
    # name -> (the [rows, in] view of the matrix it was read into, its first row there)
    placed: dict[str, tuple[object, int]] = field(default_factory=dict)


def load_shard(ckpt: Checkpoint, specs: list[TensorSpec], tp_rank: int = 0, tp_size: int = 1,
               dtype: np.dtype | None = None, backend: ArrayBackend = NUMPY,
               dataset: str = "{}", stacks: list[tuple[str, ...]] = ()) -> LoadedShard:
    """Read this rank's slice of each tensor in ``specs`` into arrays of ``dtype`` (default:
    the checkpoint's) on ``backend``'s device. ``dataset`` names the datasets read, with {}
    for the tensor name (a training checkpoint's optimizer state is shaped like the tensors).

    ``stacks``: groups of matrices (by name) a model multiplies as one (q, k and v) or alone
    in the products' layout (``decoder.matrix_stacks``). Each group is read into one
    ``layers.stored_matrix``, each part straight into its rows (on a device, one upload), and
    a part is given as its rows there (a view; where: ``placed``): loading holds each weight
    once, and no merged copy is made after it.

    Only the slice is read (an HDF5 hyperslab selection) into a host buffer, which is the
    tensor on the host when no dtype conversion is needed; vocabulary padding rows stay zero.
    """
    dtype = np.dtype(dtype or ckpt.dtype)
    pieces = {spec.name: piece_of(spec, ckpt.config, tp_rank, tp_size) for spec in specs}
    where = _places(stacks, pieces)
    matrices: dict = {}
    out = LoadedShard()
    start = perf_counter()
    flags = []              # per tensor, on the device: holds a NaN or inf (read once, below)
    with ckpt.open() as f:
        for spec in specs:
            host = _read(f, ckpt, spec, pieces[spec.name], dataset, out)
            if host.dtype != dtype:
                with np.errstate(over="ignore"):        # an overflow is refused just below
                    host = host.astype(dtype)
            if spec.name in where:
                group, first, shape = where[spec.name]
                if group not in matrices:
                    matrices[group] = stored_matrix(backend.xp, *shape, dtype)
                arr = matrices[group][first:first + host.shape[0]]
                backend.copy_in(arr, host)
                out.placed[spec.name] = (matrices[group], first)
            else:
                arr = backend.asarray(host)
            out.tensors[spec.name] = arr
            # checked where the tensor is (a GPU checks its own copy; the host its buffer)
            flags.append(any_nonfinite(backend.xp, arr if backend.on_device else host))
    _check_finite(ckpt, dataset, specs, out.tensors, flags, backend)
    backend.release_host_staging()
    out.seconds = perf_counter() - start
    return out


class PieceReader:
    """Elements [a, b) of a rank's slice of a tensor (flattened), read alone, as float32
    on the host: ZeRO-3 loads each rank's pieces of the weights and of the optimizer state
    and never the whole slice. Use it as a context (the file stays open between reads)."""

    def __init__(self, ckpt: Checkpoint, tp_rank: int, tp_size: int):
        self.ckpt, self.tp_rank, self.tp_size = ckpt, tp_rank, tp_size
        self.file: h5py.File | None = None

    def __enter__(self) -> "PieceReader":
        self.file = self.ckpt.open()
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()
        self.file = None

    def read(self, spec: TensorSpec, a: int, b: int, dataset: str = "{}") -> np.ndarray:
        """Elements [a, b) of this rank's slice of ``spec`` (of the dataset ``dataset`` names,
        as ``load_shard``'s); padding is zero; NaN or inf refused as loading refuses them."""
        piece = piece_of(spec, self.ckpt.config, self.tp_rank, self.tp_size)
        stored = storage_dtype(self.ckpt.dtype)
        weights = dataset == "{}"
        name = spec.file_name if weights else dataset.format(spec.name)
        out = np.zeros(b - a, dtype=stored)
        for src, start, extents, sub in piece.flat_regions(a, b):
            block = np.zeros(extents, dtype=stored)
            try:
                self.file[name].read_direct(block, source_sel=spec.file_region(src)
                                            if weights else src, dest_sel=sub)
            except (OSError, KeyError) as e:
                raise CheckpointError(f"{self.ckpt.path}: reading {name} failed, the file is "
                                      f"truncated or corrupt ({_first_line(e)})") from None
            out[start - a:start - a + block.size] = block.reshape(-1)
        values = (out.view(self.ckpt.dtype) if stored != self.ckpt.dtype else out
                  ).astype(np.float32)
        if not np.isfinite(values).all():
            raise CheckpointError(f"{self.ckpt.path}: {name} holds NaN or inf values; the "
                                  "file is damaged or came from a diverged training; convert "
                                  "it again or use an earlier checkpoint")
        return values


def _places(stacks: list[tuple[str, ...]], pieces: dict) -> dict[str, tuple[int, int, tuple]]:
    """Each stacked tensor's (group, first row, the group's matrix shape), from the slices
    this rank reads (``pieces``); the tensors of a group take its rows in order."""
    where = {}
    for group, names in enumerate(stacks):
        rows = sum(pieces[n].shape[0] for n in names)
        at = 0
        for n in names:
            where[n] = (group, at, (rows, pieces[n].shape[1]))
            at += pieces[n].shape[0]
    return where


def _read(f: h5py.File, ckpt: Checkpoint, spec: TensorSpec, piece, dataset: str,
          out: LoadedShard) -> np.ndarray:
    """This rank's slice ``piece`` of ``spec`` (of the dataset ``dataset`` names), read into
    a host buffer of the checkpoint's dtype; its bytes counted in ``out``."""
    stored = storage_dtype(ckpt.dtype)
    raw = np.zeros(piece.shape, dtype=stored)
    # the weights of a fused tensor's part are rows of it; optimizer state is per part
    name, source = ((spec.file_name, spec.file_region(piece.source)) if dataset == "{}"
                    else (dataset.format(spec.name), piece.source))
    try:
        f[name].read_direct(raw, source_sel=source, dest_sel=piece.dest)
    except (OSError, KeyError) as e:
        raise CheckpointError(f"{ckpt.path}: reading {name} failed, the "
                              f"file is truncated or corrupt ({_first_line(e)})") from None
    out.bytes_read += piece.source_numel * stored.itemsize
    return raw.view(ckpt.dtype) if stored != ckpt.dtype else raw


def _check_finite(ckpt: Checkpoint, dataset: str, specs: list[TensorSpec], tensors: dict,
                  flags: list, backend: ArrayBackend) -> None:
    """NaN or inf in weights turns every output into garbage: refuse them at load time. The
    test runs where the tensors are (a GPU checks its own copy) and is read back once."""
    if not flags or not backend.to_host(backend.xp.stack(flags)).any():
        return
    for spec, flag in zip(specs, flags):
        if bool(backend.to_host(flag)):
            values = backend.to_host(tensors[spec.name])
            where = tuple(int(i) for i in np.argwhere(nonfinite(np, values))[0])
            name = dataset.format(spec.name)
            if values.dtype != ckpt.dtype and _stored_finite(ckpt, name, spec):
                raise CheckpointError(
                    f"{ckpt.path}: {name} has values too large for {dtype_name(values.dtype)} "
                    f"(the first at local index {where}); use --dtype "
                    f"{dtype_name(ckpt.dtype)}, the checkpoint's own")
            raise CheckpointError(
                f"{ckpt.path}: {name} holds NaN or inf values (first at "
                f"local index {where}); the file is damaged or came from a diverged "
                f"training; convert it again or use an earlier checkpoint")


def _stored_finite(ckpt: Checkpoint, name: str, spec: TensorSpec) -> bool:
    """Whether the tensor as stored is finite (its cast overflowed), read whole: only once
    its cast was found not to be."""
    stored = spec.file_name if name == spec.name else name
    return bool(np.isfinite(read_tensor(ckpt, stored).astype(np.float64)).all())


def read_tensor(ckpt: Checkpoint, name: str) -> np.ndarray:
    """One whole tensor in the checkpoint's dtype (for tools and tests, not for loading)."""
    with ckpt.open() as f:
        raw = f[name][()]
    return raw.view(ckpt.dtype) if raw.dtype != ckpt.dtype else raw


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
