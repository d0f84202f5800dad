"""Training checkpoints (docs/design.md §4): a weights checkpoint plus the optimizer state and the
training state, written from every rank's own slices and read back under any layout.

    DIR/step-S.h5       the model tensors (float32 master weights, Hugging Face names),
                        optimizer/<tensor name>/<state name> of the same shapes, and a
                        ``train`` group whose attributes hold the step, the samples consumed
                        and the run's settings; the source checkpoint's tokenizer
    DIR/step-S.parts/   the ranks' part files, when every rank wrote its own slices
                        (``checkpoint.parts``: step-S.h5's tensors are virtual datasets
                        over them)
    DIR/latest          the file name of the newest complete checkpoint

Exactly one rank writes each element: the rank that counts a slice (``Param.counted``) on
the first rank of its holders (dp and cp replicas write nothing twice); with ZeRO each
replica writes the optimizer state of its own segments (ZeRO 2 and 3: their weights too).

Writing, by default (``my_regions``, ``commit_parts``): every writer puts its slices into
its part file in ``DIR/.step-S.parts.tmp/``, all at once; once all are complete, rank 0
writes the top file under a temporary name, renames the folder and the file into place and
then updates ``latest``. ``train.serial_save`` (``create_file``, ``write_regions``,
``commit``): rank 0 creates every dataset of one self-contained file, the ranks write their
slices into it one at a time, rank 0 renames it into place. Either way a crash or a failed
write leaves the previous checkpoint and ``latest`` as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from ...checkpoint import Checkpoint, CheckpointError, load_shard, open_checkpoint
from ...checkpoint.files import check_space, reserve, write_point, write_text, writing
from ...checkpoint.format import (ATTR_CONFIG, ATTR_DTYPE, ATTR_VERSION, FORMAT_VERSION,
                                  TOKENIZER_GROUP, chunk_shape)
from ...checkpoint.parts import Region, parts_folder, write_top
from ...models.sharding import piece_of
from ...models.tensors import model_tensors, stored_tensors
from ...parallel.errors import HpcparError

TRAIN_GROUP = "train"
OPTIMIZER_GROUP = "optimizer"
LATEST = "latest"


def checkpoint_name(step: int) -> str:
    return f"step-{step}.h5"


def _write_header(f, source, train_attrs: dict, tokenizer: dict) -> None:
    """What a checkpoint file holds beside its tensors: the format, the model's config, the
    dtype, the training state (``train`` group) and the tokenizer files."""
    f.attrs[ATTR_VERSION] = FORMAT_VERSION
    f.attrs[ATTR_CONFIG] = json.dumps(source.hf_config, sort_keys=True)
    f.attrs[ATTR_DTYPE] = "float32"
    f.attrs["source"] = f"hpcpar train, step {train_attrs['step']}"
    group = f.create_group(TRAIN_GROUP)
    for k, v in train_attrs.items():
        group.attrs[k] = v
    for name, data in tokenizer.items():
        f.require_group(TOKENIZER_GROUP).create_dataset(
            name, data=np.frombuffer(data, dtype=np.uint8))


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _computed(source) -> list:
    """The tensors trained, each with optimizer state: the model's, or a LoRA run's
    adapters (its ``source`` names them: ``train.lora.AdapterSource``)."""
    return getattr(source, "trained", None) or model_tensors(source.config)


def _stored(source) -> list:
    """The weights a checkpoint stores: the model's (fused tensors whole), or a LoRA run's
    adapters."""
    return getattr(source, "trained", None) or stored_tensors(source.config)


def checkpoint_bytes(source: Checkpoint, state_names: tuple[str, ...]) -> int:
    """The bytes of a training checkpoint of ``source``'s model: float32 weights and each
    optimizer state, and the tokenizer files kept with them."""
    values = sum(int(np.prod(spec.shape)) for spec in _computed(source))
    return values * 4 * (1 + len(state_names)) + sum(
        len(data) for data in source.tokenizer_files().values())


def create_file(path: Path, source: Checkpoint, state_names: tuple[str, ...],
                train_attrs: dict) -> None:
    """Rank 0: every dataset of the checkpoint, empty, in the temporary file."""
    cfg = source.config
    tokenizer = source.tokenizer_files()
    specs = _computed(source)            # the computation's tensors: optimizer state each
    check_space(path, checkpoint_bytes(source, state_names))
    # every dataset's space assigned now (not filled), then reserved below: the ranks'
    # writes into it cannot meet a full disk
    early = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    early.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    early.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    with writing(path), h5py.File(_tmp(path), "w") as f:
        _write_header(f, source, train_attrs, tokenizer)
        for spec in _stored(source):            # the weights, fused tensors whole
            f.create_dataset(spec.name, spec.shape, dtype=np.float32,
                             chunks=chunk_shape(spec, cfg, 4), dcpl=early.copy())
        for spec in specs:
            for state in state_names:
                f.create_dataset(f"{OPTIMIZER_GROUP}/{spec.name}/{state}", spec.shape,
                                 dtype=np.float32, chunks=chunk_shape(spec, cfg, 4),
                                 dcpl=early.copy())
        write_point(path)
    reserve(_tmp(path))


def write_regions(path: Path, regions: list[Region]) -> None:
    """This rank's regions (``my_regions``) into the one file of a serial save."""
    with writing(path), h5py.File(_tmp(path), "r+") as f:
        write_point(path)
        for r in regions:
            f[r.target][r.region] = r.data


def _flat_regions(piece, a: int, values: np.ndarray):
    """(region of the full tensor, its values) for elements [a, a + len(values)) of the
    local piece (C order), skipping vocabulary padding rows (``Piece.flat_regions``)."""
    for src, start, extents, sub in piece.flat_regions(a, a + values.size):
        block = values[start - a:start - a + int(np.prod(extents))].reshape(extents)
        yield src, block[sub]


def remove_partial(out_dir: Path) -> None:
    """Checkpoints a crashed run left half-written (the folder's lock is held): temporary
    files and part folders, and a part folder whose top file never came."""
    for tmp in out_dir.glob(".step-*.h5.tmp"):
        tmp.unlink(missing_ok=True)
    for tmp in [*out_dir.glob(".step-*.parts.tmp"), *out_dir.glob(".step-*.parts.old")]:
        shutil.rmtree(tmp, ignore_errors=True)
    for folder in out_dir.glob("step-*.parts"):
        if not folder.with_suffix(".h5").exists():
            shutil.rmtree(folder, ignore_errors=True)


def discard(path: Path) -> None:
    """Rank 0: drop the half-written checkpoint ``path`` (a write failed); ``latest`` still
    names the previous one."""
    _tmp(path).unlink(missing_ok=True)
    shutil.rmtree(tmp_parts(path), ignore_errors=True)


def commit(path: Path) -> None:
    """Rank 0: move the finished file into place, then point ``latest`` at it."""
    with writing(path):
        os.replace(_tmp(path), path)
        _drop_parts(path)                  # a checkpoint of this step written by the ranks
    write_text(path.parent / LATEST, path.name + "\n")


# ---- every rank at once: part files and a top file of virtual datasets --------------------

def tmp_parts(path: Path) -> Path:
    """Where the ranks write the part files of ``path`` until it is complete."""
    return path.with_name(f".{parts_folder(path).name}.tmp")


def prepare_parts(path: Path, source: Checkpoint, state_names: tuple[str, ...]) -> None:
    """Rank 0, before the ranks write: the space checked, a fresh temporary parts folder."""
    path.parent.mkdir(exist_ok=True)
    check_space(path, checkpoint_bytes(source, state_names))
    with writing(path):
        shutil.rmtree(tmp_parts(path), ignore_errors=True)
        tmp_parts(path).mkdir()


def my_regions(held, states: dict[str, dict], cfg, tp_rank: int, tp_size: int, to_host,
               copy: bool) -> list[Region]:
    """What this rank writes: its counted slices of every weight and optimizer state it
    holds first among its replicas (``held``: ``weight_holders.Holders``), and with ZeRO the
    optimizer state of its segments (with ZeRO 2 and 3 their weights too: every rank its
    own). ``copy``: the values are copies (a snapshot the next steps do not change), else
    views where they can be."""
    take = (lambda a: np.array(a, copy=True)) if copy else (lambda a: a)
    out: list[Region] = []
    for group in held:
        if group.first and not group.sharded:
            for p in group.params:
                if not p.counted:
                    continue
                piece = piece_of(p.spec, cfg, tp_rank, tp_size)
                out.append(Region(p.spec.file_name, p.spec.file_region(piece.source),
                                  take(to_host(p.master)[piece.dest])))
                if group.zero:
                    continue
                for state, value in states.get(p.name, {}).items():
                    out.append(Region(f"{OPTIMIZER_GROUP}/{p.name}/{state}", piece.source,
                                      take(to_host(value)[piece.dest])))
        if group.zero:
            for seg in group.zero.segments:
                if not seg.counted:
                    continue
                piece = piece_of(seg.spec, cfg, tp_rank, tp_size)
                a = group.zero.offset[seg.name]
                if group.sharded:
                    for region, block in _flat_regions(piece, a, to_host(seg.master)):
                        out.append(Region(seg.spec.file_name, seg.spec.file_region(region),
                                          take(block)))
                for state, value in states.get(seg.name, {}).items():
                    for region, block in _flat_regions(piece, a, to_host(value).reshape(-1)):
                        out.append(Region(f"{OPTIMIZER_GROUP}/{seg.name}/{state}", region,
                                          take(block)))
    return out


def snapshot_bytes(held, cfg, tp_rank: int, tp_size: int, states: int) -> int:
    """The host bytes of this rank's ``my_regions`` copied (weights and ``states`` optimizer
    states each), from the shapes alone."""
    total = 0
    for group in held:
        if group.first and not group.sharded:
            for p in group.params:
                if p.counted:
                    dest = piece_of(p.spec, cfg, tp_rank, tp_size).dest
                    n = int(np.prod([s.stop - s.start for s in dest])) * 4
                    total += n * (1 if group.zero else 1 + states)
        if group.zero:
            total += sum(seg.master.size for seg in group.zero.segments if seg.counted) * 4 \
                * (states + (1 if group.sharded else 0))
    return total


def commit_parts(path: Path, source: Checkpoint, state_names: tuple[str, ...],
                 train_attrs: dict) -> None:
    """Rank 0, once every rank's part file is complete: the top file over them, the folder
    and the file renamed into place, then ``latest``."""
    tmp_folder, folder = tmp_parts(path), parts_folder(path)
    tensors = {spec.name: spec.shape for spec in _stored(source)}
    states = {f"{OPTIMIZER_GROUP}/{spec.name}/{state}": spec.shape
              for spec in _computed(source) for state in state_names}
    tokenizer = source.tokenizer_files()

    def fill(f):
        _write_header(f, source, train_attrs, tokenizer)

    parts = sorted(p.name for p in tmp_folder.glob("rank-*.h5"))
    write_top(_tmp(path), tmp_folder, folder.name, parts, tensors | states, set(states), fill)
    with writing(path):
        _drop_parts(path)                  # an earlier run's checkpoint of this step
        os.replace(tmp_folder, folder)
        os.replace(_tmp(path), path)
        _sync_folder(path.parent)
    write_text(path.parent / LATEST, path.name + "\n")


def _drop_parts(path: Path) -> None:
    folder = parts_folder(path)
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        shutil.rmtree(old, ignore_errors=True)


def _sync_folder(folder: Path) -> None:
    """The renames in ``folder`` on disk (a crash after ``latest`` finds them)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def resolve_resume(spec: str | None, out_dir: Path) -> Path | None:
    """The checkpoint to resume from: a path, ``auto`` (DIR/latest if it exists), or None."""
    if not spec:
        return None
    if spec != "auto":
        return Path(spec)
    latest = out_dir / LATEST
    if not latest.exists():
        return None
    name = latest.read_text().strip()
    path = out_dir / name
    if not path.exists():
        raise HpcparError(f"{latest} names {name}, which does not exist; remove {latest} or "
                          "resume from an explicit --resume PATH")
    return path


def open_resume(path: Path, model: Checkpoint) -> tuple[Checkpoint, dict]:
    """Validate a training checkpoint to resume from; returns it and its train attributes."""
    ckpt = open_checkpoint(path)
    with ckpt.open() as f:
        group = f.get(TRAIN_GROUP)
        if group is None:
            raise CheckpointError(f"{path}: not a training checkpoint (no '{TRAIN_GROUP}' "
                                  "group); give it as --checkpoint to start a new training")
        attrs = {k: _plain(v) for k, v in group.attrs.items()}
    if ckpt.config != model.config:
        diff = [k for k in ckpt.config.__dataclass_fields__
                if getattr(ckpt.config, k) != getattr(model.config, k)]
        raise CheckpointError(f"{path}: its model differs from --checkpoint {model.path} "
                              f"({', '.join(diff)}); resume with the checkpoint it was "
                              "trained from")
    return ckpt, attrs


def load_optimizer_state(ckpt: Checkpoint, specs, state_names, tp_rank: int, tp_size: int,
                         backend) -> dict[str, dict]:
    """name -> {state name -> this rank's slice} from a training checkpoint."""
    out: dict[str, dict] = {}
    for state in state_names:
        shard = load_shard(ckpt, specs, tp_rank, tp_size, np.float32, backend,
                           dataset=f"{OPTIMIZER_GROUP}/{{}}/{state}")
        for name, value in shard.tensors.items():
            out.setdefault(name, {})[state] = value
    return out


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v
