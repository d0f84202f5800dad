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
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..models.tensors import stored_tensors
from ..parallel.dtypes import FLOAT_DTYPES, bfloat16, float_dtype
from ..parallel.errors import HpcparError
from .files import check_space, write_point, writing
from .format import logical_dtype
from .reader import Checkpoint, open_checkpoint

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
    name: str
    shape: tuple[int, ...]
    nbytes: int


def export(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
           shard_size: int = DEFAULT_SHARD_SIZE) -> list[Path]:
    """Write ``checkpoint``'s weights as a Hugging Face folder ``out_dir`` (in ``dtype``,
    default the stored one); returns the files written."""
    if dtype is not None and dtype not in SAFETENSORS_DTYPES:
        raise HpcparError(f"--dtype {dtype!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
    ckpt = open_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    target = float_dtype(dtype) if dtype else np.dtype(ckpt.dtype)
    _check_target(out_dir)
    entries = [_Entry(s.name, tuple(s.shape), int(np.prod(s.shape)) * target.itemsize)
               for s in stored_tensors(ckpt.config)]
    shards = _shards(entries, shard_size)
    extra = ckpt.tokenizer_files()
    check_space(out_dir, sum(e.nbytes for e in entries) + sum(map(len, extra.values())))
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with writing(out_dir):
            written = _write_folder(ckpt, tmp, shards, target, extra)
        if out_dir.exists():                      # an empty folder the user made for it
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out_dir / p.name for p in written]


def _check_target(out_dir: Path) -> None:
    """A new folder, or an empty one (so it cannot hold the checkpoint either)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise HpcparError(f"{out_dir} is a file; export writes a new folder: choose another "
                          "name")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise HpcparError(f"{out_dir} exists and is not an empty folder; export writes a new "
                          "folder: remove it or choose another name")
    if not out_dir.parent.is_dir():
        raise HpcparError(f"output folder {out_dir.parent} does not exist; create it first")


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
                  dtype: np.dtype, extra: dict[str, bytes]) -> list[Path]:
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    written = []
    with ckpt.open() as f:
        for name, shard in zip(names, shards):
            written.append(_write_safetensors(folder / name, f, shard, dtype))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
                 "weight_map": {e.name: n for n, s in zip(names, shards) for e in s}}
        written.append(_write_json(folder / "model.safetensors.index.json", index))
    config = {k: v for k, v in ckpt.hf_config.items() if k != "torch_dtype"}
    config["dtype"] = _dtype_name(dtype)          # transformers 5's name for torch_dtype
    written.append(_write_json(folder / "config.json", config))
    for name, data in extra.items():                 # tokenizer and generation config files
        (folder / name).write_bytes(data)
        written.append(folder / name)
    return written


def _write_safetensors(path: Path, f, entries: list[_Entry], dtype: np.dtype) -> Path:
    """One safetensors file, tensor by tensor (the format: little-endian u64 header length,
    a JSON header of dtype, shape and [begin, end) offsets, padded to 8 bytes, the data)."""
    header, offset = {}, 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[_dtype_name(dtype)],
                          "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    write_point(path)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for e in entries:
            dset = f[e.name]
            values = np.asarray(dset[()])
            if logical_dtype(dset) == bfloat16:
                values = values.view(bfloat16)
            out.write(np.ascontiguousarray(values.astype(dtype, copy=False)).tobytes())
    return path


def _write_json(path: Path, value) -> Path:
    write_point(path)
    path.write_text(json.dumps(value, indent=2) + "\n")
    return path


def _dtype_name(dtype: np.dtype) -> str:
    return next(name for name, d in FLOAT_DTYPES.items() if d == np.dtype(dtype))
