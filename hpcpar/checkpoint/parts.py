"""Checkpoints that many ranks write at once (docs/design.md §4): each writer's slices in a
file of its own, and a top file whose tensors are HDF5 virtual datasets over them.

    DIR/step-S.h5                   the checkpoint every reader opens: each tensor a virtual
                                    dataset mapping its regions to the part files, and the
                                    attributes, groups and tokenizer files a single file has
    DIR/step-S.parts/rank-R.h5      writer R's slices, one dataset per region of a tensor
                                    (attributes ``target``, the tensor, and ``region``,
                                    [[start, stop], ...] in it)

Readers see the whole tensors (HDF5 maps a slice read onto the parts it touches), so loading
under any layout, ``export`` and ``show`` are unchanged. Source paths are relative to the top
file (``step-S.parts/rank-R.h5``): the checkpoint moves or copies with its folder, the top
file and its ``.parts`` folder together. A region no part covers reads as NaN (the fill
value), which loading refuses; a missing part file is refused when the checkpoint is opened
(``check_parts``), naming it.

A writer makes its datasets first (space allocated, then reserved: HDF5 must not meet a full
disk, see ``files``), writes into them, and syncs the file to disk; the top file is made
when every part is complete (by one rank) and names them in ``hpcpar_parts``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from ..parallel.errors import HpcparError
from .files import reserve, write_point, writing

ATTR_PARTS = "hpcpar_parts"             # the top file's part files, relative to its folder
ATTR_INDEX = "hpcpar_regions"           # a part file's [[dataset, tensor, region], ...]
PARTS_SUFFIX = ".parts"
# virtual datasets need HDF5 1.10 to read; its format also holds attributes over 64 kB
# (a part file's index, the list of thousands of parts)
LIBVER = ("v110", "latest")


@dataclass(frozen=True)
class Region:
    """``data`` is ``target[region]`` of the whole tensor (or optimizer state) ``target``."""

    target: str
    region: tuple[slice, ...]
    data: np.ndarray


def parts_folder(path: str | Path) -> Path:
    """The folder of ``path``'s part files: ``step-S.h5`` -> ``step-S.parts``."""
    path = Path(path)
    return path.with_name(path.stem + PARTS_SUFFIX)


def part_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def write_part(file: Path, regions: list[Region], cancelled: Callable[[], bool] = lambda: False,
               name: Path | None = None) -> int:
    """One writer's regions into ``file`` (new), synced to disk; returns the bytes written.
    ``cancelled`` is asked between regions (a job that failed elsewhere stops writing);
    ``name``: the checkpoint a failure names (default: ``file``)."""
    early = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    early.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    early.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    nbytes = 0
    with writing(name or file):
        write_point(file)
        with h5py.File(file, "w", locking=False, libver=LIBVER) as f:
            dsets = [f.create_dataset(str(k), r.data.shape, dtype=r.data.dtype,
                                      dcpl=early.copy()) for k, r in enumerate(regions)]
            # what each dataset is, in one attribute: the top file is made from these
            f.attrs[ATTR_INDEX] = json.dumps([[str(k), r.target,
                                               [[s.start, s.stop] for s in r.region]]
                                              for k, r in enumerate(regions)])
            f.flush()
            reserve(file)                    # the space of every dataset, before any data
            for dset, r in zip(dsets, regions):
                if cancelled():
                    return nbytes
                if r.data.size:
                    dset.write_direct(np.ascontiguousarray(r.data))
                nbytes += r.data.nbytes
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return nbytes


def write_top(path: Path, folder: Path, folder_name: str, part_files: list[str],
              tensors: dict[str, tuple[int, ...]], optional: set[str],
              fill: Callable[[h5py.File], None]) -> None:
    """The top file ``path`` (new, synced): a float32 virtual dataset for each of
    ``tensors`` (name -> shape) over the regions the part files ``folder/part_files`` hold,
    which it names relative to ``path``'s folder as ``folder_name/part`` (the folder is
    renamed so afterwards); ``fill(f)`` adds the attributes and groups. Every tensor must be
    covered exactly once, except ``optional`` ones, which may be covered not at all (then
    they read as zeros)."""
    maps: dict[str, list] = {name: [] for name in tensors}
    for part in part_files:
        with h5py.File(folder / part, "r", locking=False) as f:
            index = json.loads(f.attrs[ATTR_INDEX])
        for key, target, region in index:
            if target not in maps:
                raise HpcparError(f"{folder / part}: its dataset {key} is of {target}, no "
                                  "tensor of this checkpoint")
            maps[target].append((tuple(slice(a, b) for a, b in region),
                                 f"{folder_name}/{part}".encode(), key.encode()))
    with writing(path):
        write_point(path)
        with h5py.File(path, "w", locking=False, libver=LIBVER) as f:
            fill(f)
            f.attrs[ATTR_PARTS] = json.dumps([f"{folder_name}/{p}" for p in part_files])
            for name, shape in tensors.items():
                covered = sum(_size(region) for region, *_ in maps[name])
                numel = int(np.prod(shape))
                if covered != numel and not (covered == 0 and name in optional):
                    raise HpcparError(f"{path}: the parts cover {covered} of the {numel} "
                                      f"values of {name}; a checkpoint needs each exactly once")
                _virtual_dataset(f, name, shape, maps[name], 0.0 if covered == 0 else np.nan)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _size(region: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in region)


def _virtual_dataset(f: h5py.File, name: str, shape: tuple[int, ...], maps: list,
                     fill: float) -> None:
    """A float32 virtual dataset ``name`` of ``shape`` whose ``region`` is the whole source
    dataset ``key`` of ``file``, for each (region, file, key) of ``maps`` (h5py's low-level
    calls: ``VirtualLayout`` costs a millisecond a mapping)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_fill_value(np.array(fill, np.float32))
    for region, file, key in maps:
        extents = tuple(s.stop - s.start for s in region)
        vspace = h5py.h5s.create_simple(shape)
        vspace.select_hyperslab(tuple(s.start for s in region), extents)
        dcpl.set_virtual(vspace, file, key, h5py.h5s.create_simple(extents))
    parent, _, leaf = name.rpartition("/")
    group = f.require_group(parent) if parent else f
    h5py.h5d.create(group.id, leaf.encode(), h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple(shape),
                    dcpl=dcpl)


def check_parts(path: Path, f: h5py.File) -> str | None:
    """What is wrong with the part files of the open top file ``f`` at ``path`` (a part
    missing), or None (also for a checkpoint in one file)."""
    names = f.attrs.get(ATTR_PARTS)
    if names is None:
        return None
    for name in json.loads(names):
        if not (path.parent / name).is_file():
            return (f"{path}: its part file {path.parent / name} is missing; a checkpoint "
                    f"written by every rank is the file and its folder "
                    f"{parts_folder(path).name}/, copied or moved together")
    return None


def stored_bytes(path: str | Path) -> int:
    """The bytes of the checkpoint ``path`` on disk: its file and its part files if any."""
    path = Path(path)
    folder = parts_folder(path)
    parts = sum(p.stat().st_size for p in folder.glob("rank-*.h5")) if folder.is_dir() else 0
    return path.stat().st_size + parts
