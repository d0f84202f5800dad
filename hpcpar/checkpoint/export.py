"""An HDF5 checkpoint back to a Hugging Face folder that ``from_pretrained`` loads as it is.

    DIR/config.json                        the config.json kept at conversion (``hf_config``)
    DIR/model.safetensors                  every stored tensor, named and oriented as stored
    DIR/model-0000k-of-0000n.safetensors   or shards of at most ``shard_size`` bytes, with
    DIR/model.safetensors.index.json       the index transformers reads
    DIR/generation_config.json, tokenizer.json, ...   the files kept at conversion

The checkpoint already holds transformers' names and layouts (Phi-3's fused projections
fused, a tied head stored once as the embedding), so a tensor is copied, never reshaped; a
training checkpoint's optimizer state stays behind. safetensors' own writers take every
tensor of a file at once, so the files are written here, one tensor at a time (an 8-byte
header length, the JSON header, then the raw bytes in its order), and the library reads them
back in the tests. The folder is written beside its target and renamed into place at the
end, after the free space was checked.

As every command that writes (``files``): the target is checked before any work (a new or
empty folder, its parent writable), one export at a time holds its lock, which sits beside
it, and holding it makes every other temporary folder of the target a dead writer's, removed.
Each tensor is read as jobs load it (``load_shard``), so NaN or inf weights are refused as
they refuse them, naming the tensor; a failure or a stop leaves no temporary folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..models.tensors import TensorSpec, stored_tensors
from ..parallel.device.dtypes import FLOAT_DTYPES, float_dtype
from ..parallel.errors import HpcparError
from .files import OutputLock, check_space, check_writable, write_point, writing
from .reader import Checkpoint, load_shard, open_checkpoint

SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
DEFAULT_SHARD_SIZE = 5 * 10 ** 9          # transformers' save_pretrained default: "5GB"
_UNITS = {"kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "b": 1}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes (transformers' max_shard_size)."""
    raw = text.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if raw.endswith(u)), "")
    try:
        value = float(raw[:len(raw) - len(unit)]) * _UNITS.get(unit, 1)
    except ValueError:
        value = 0
    if not (math.isfinite(value) and value >= 1):
        raise HpcparError(f"--shard-size {text!r} is not a size; give bytes or a number with "
                          "KB, MB, GB (or KiB, MiB, GiB), such as 5GB")
    return int(value)


@dataclass(frozen=True)
class _Entry:
    spec: TensorSpec
    nbytes: int                     # in the exported dtype
    values: np.ndarray | None = None    # an inert tensor's, kept aside (else: load it)


def export(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
           shard_size: int = DEFAULT_SHARD_SIZE,
           check_stop: Callable[[], None] = lambda: None,
           add: dict[str, Callable[[], np.ndarray]] | None = None) -> list[Path]:
    """Write ``checkpoint``'s weights as a Hugging Face folder ``out_dir`` (in ``dtype``,
    default the stored one); returns the files written. ``check_stop`` is called before
    each tensor and raises to end the export (the command's, on a stop request). ``add``:
    by tensor name, what to add to it in float32 before the cast (a LoRA adapter merged:
    ``peft.merged_deltas``)."""
    if dtype is not None and dtype not in SAFETENSORS_DTYPES:
        raise HpcparError(f"--dtype {dtype!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
    ckpt = open_checkpoint(checkpoint)
    target = float_dtype(dtype) if dtype else np.dtype(ckpt.dtype)
    _check_target(Path(out_dir))
    out_dir = Path(out_dir).resolve()    # 'a/..' has no name for the temporary and the lock
    entries = [_Entry(s, int(np.prod(s.shape)) * target.itemsize)
               for s in stored_tensors(ckpt.config)]
    entries += [_Entry(TensorSpec(name, a.shape, "inert", None), a.size * target.itemsize, a)
                for name, a in ckpt.inert_tensors().items()]
    shards = _shards(entries, shard_size)
    extra = ckpt.tokenizer_files()
    with OutputLock(out_dir, beside=True):
        _check_target(out_dir)            # again: another export may have finished meanwhile
        _remove_dead_temporaries(out_dir)
        check_space(out_dir, sum(e.nbytes for e in entries) + sum(map(len, extra.values())))
        written = _write_in_place(out_dir, lambda tmp: _write_folder(
            ckpt, tmp, shards, target, extra, check_stop, add or {}))
    return [out_dir / p.name for p in written]


def _write_in_place(out_dir: Path, write: Callable[[Path], list[Path]]) -> list[Path]:
    """``write`` fills a temporary folder beside ``out_dir``, renamed to it once full;
    anything that ends it early (a failure, a stop, a second Ctrl-C) removes the temporary
    folder."""
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with writing(out_dir):
            tmp.mkdir()
            written = write(tmp)
            if out_dir.exists():                  # an empty folder the user made for it
                out_dir.rmdir()
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def _remove_dead_temporaries(out_dir: Path) -> None:
    """The temporary folders exports killed midway (SIGKILL, a lost node) left beside
    ``out_dir``: a writer holds the target's lock while its temporary folder exists, so
    once this export holds it every other one is a dead writer's."""
    prefix = f".{out_dir.name}.tmp-"
    for tmp in out_dir.parent.iterdir():
        if tmp.name.startswith(prefix) and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)


def _check_target(out_dir: Path) -> None:
    """A new folder, or an empty one (so it cannot hold the checkpoint either), in a folder
    this user can write. Not a link: the folder renamed into place would replace the link,
    not fill the folder it names. Not the folder the command runs in: renamed over, the
    shell would be left in a deleted folder."""
    if out_dir.is_symlink():
        raise HpcparError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}); export "
                          "writes a new folder in its place: give the folder it names, or "
                          "another name")
    if out_dir.resolve() == Path.cwd():
        raise HpcparError(f"{out_dir} is the folder export runs in; export writes a new "
                          f"folder: give a new name, such as {out_dir / 'hf'}")
    if out_dir.exists() and not out_dir.is_dir():
        raise HpcparError(f"{out_dir} is a file; export writes a new folder: choose another "
                          "name")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise HpcparError(f"{out_dir} exists and is not an empty folder; export writes a new "
                          "folder: remove it or choose another name")
    if not out_dir.parent.is_dir():
        raise HpcparError(f"output folder {out_dir.parent} does not exist; create it first")
    check_writable(out_dir.parent)


def _shards(entries: list[_Entry], shard_size: int) -> list[list[_Entry]]:
    """The tensors in files of at most ``shard_size`` bytes (a larger tensor alone), in
    order, as transformers' ``save_pretrained`` splits them."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _write_folder(ckpt: Checkpoint, folder: Path, shards: list[list[_Entry]],
                  dtype: np.dtype, extra: dict[str, bytes],
                  check_stop: Callable[[], None], add: dict) -> list[Path]:
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    written = [_write_safetensors(folder / name, ckpt, shard, dtype, check_stop, add)
               for name, shard in zip(names, shards)]
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
                 "weight_map": {e.spec.name: n for n, s in zip(names, shards) for e in s}}
        written.append(_write_json(folder / "model.safetensors.index.json", index))
    config = {k: v for k, v in ckpt.hf_config.items() if k != "torch_dtype"}
    config["dtype"] = _dtype_name(dtype)          # transformers 5's name for torch_dtype
    written.append(_write_json(folder / "config.json", config))
    for name, data in extra.items():                 # tokenizer and generation config files
        (folder / name).write_bytes(data)
        written.append(folder / name)
    return written


def _write_safetensors(path: Path, ckpt: Checkpoint, entries: list[_Entry], dtype: np.dtype,
                       check_stop: Callable[[], None], add: dict) -> Path:
    """One safetensors file, tensor by tensor (the format: little-endian u64 header length,
    a JSON header of dtype, shape and [begin, end) offsets, padded to 8 bytes, the data).
    Each tensor is read as a job loads it, NaN or inf (stored, or from the cast to
    ``dtype``) refused by the same check (``load_shard``)."""
    header, offset = {}, 0
    for e in entries:
        header[e.spec.name] = {"dtype": SAFETENSORS_DTYPES[_dtype_name(dtype)],
                               "shape": list(e.spec.shape),
                               "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    write_point(path)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for e in entries:
            check_stop()
            if e.spec.name in add:
                values = load_shard(ckpt, [e.spec], dtype=np.float32).tensors[e.spec.name]
                values = (values + add[e.spec.name]()).astype(dtype)
            else:
                values = (e.values.astype(dtype) if e.values is not None
                          else load_shard(ckpt, [e.spec], dtype=dtype).tensors[e.spec.name])
            out.write(values.tobytes())
    return path


def _write_json(path: Path, value) -> Path:
    write_point(path)
    path.write_text(json.dumps(value, indent=2) + "\n")
    return path


def _dtype_name(dtype: np.dtype) -> str:
    return next(name for name, d in FLOAT_DTYPES.items() if d == np.dtype(dtype))
