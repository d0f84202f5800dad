"""Writing a checkpoint atomically, one tensor at a time.

The file is built under a temporary name beside the target and renamed into place only when
every tensor is written, so a crash or a bad tensor never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np

from ..models.config import ModelConfig
from ..models.tensors import TensorSpec, stored_tensors
from ..parallel.device.dtypes import dtype_name
from ..parallel.errors import HpcparError
from .files import (AtomicPath, WriteError, check_space, is_write_failure, quiet_deallocation,
                    write_failure, write_point, writing)
from .format import (ATTR_CONFIG, ATTR_DTYPE, ATTR_VERSION, FORMAT_VERSION, INERT_GROUP,
                     TOKENIZER_GROUP, chunk_shape, storage_dtype, to_storage)


class CheckpointWriter:
    """Context manager: ``with CheckpointWriter(path, hf_config, dtype) as w: w.write(spec, a)``.

    Every tensor of the model must be written before the context closes; the file appears at
    ``path`` only then.
    """

    def __init__(self, path: str | Path, hf_config: Mapping[str, Any], dtype: np.dtype,
                 source: str = ""):
        self.config = ModelConfig.from_hf(hf_config, source=source or "config")
        self.hf_config = dict(hf_config)
        self.dtype = np.dtype(dtype)
        self.source = source
        self.expected = {s.name: s for s in stored_tensors(self.config)}
        self.written: set[str] = set()
        self._out = AtomicPath(path)
        self._file: h5py.File | None = None

    def __enter__(self) -> "CheckpointWriter":
        out_dir = self._out.path.parent
        if not out_dir.is_dir():
            raise HpcparError(f"{self._out.path}: folder {out_dir} does not exist")
        nbytes = sum(int(np.prod(s.shape)) for s in self.expected.values()) * self.dtype.itemsize
        check_space(self._out.path, nbytes)
        try:
            with writing(self._out.path):
                self._file = h5py.File(self._out.tmp, "w")
                self._file.attrs[ATTR_VERSION] = FORMAT_VERSION
                self._file.attrs[ATTR_CONFIG] = json.dumps(self.hf_config, sort_keys=True)
                self._file.attrs[ATTR_DTYPE] = dtype_name(self.dtype)
                if self.source:
                    self._file.attrs["source"] = self.source
        except WriteError:
            self._close_and_discard()
            raise
        return self

    def write(self, spec: TensorSpec, array: np.ndarray) -> None:
        """Store ``array`` (any float dtype; cast to the checkpoint's) under ``spec.name``."""
        if spec.name not in self.expected:
            raise HpcparError(f"{spec.name}: not a tensor of this model")
        if tuple(array.shape) != spec.shape:
            raise HpcparError(f"{spec.name}: shape {tuple(array.shape)} does not match the "
                              f"config, which implies {spec.shape}")
        data = to_storage(np.ascontiguousarray(array, dtype=self.dtype))
        chunks = chunk_shape(spec, self.config, data.dtype.itemsize)
        with writing(self._out.path):
            write_point(self._out.path)
            dset = self._file.create_dataset(spec.name, data=data, chunks=chunks)
            if storage_dtype(self.dtype) != self.dtype:
                dset.attrs[ATTR_DTYPE] = dtype_name(self.dtype)
        self.written.add(spec.name)

    def add_file(self, name: str, data: bytes) -> None:
        """Keep a small file (a tokenizer's) inside the checkpoint."""
        with writing(self._out.path):
            group = self._file.require_group(TOKENIZER_GROUP)
            group.create_dataset(name, data=np.frombuffer(data, dtype=np.uint8))

    def keep_inert(self, name: str, array: np.ndarray) -> None:
        """Keep a tensor that computes nothing (``models.tensors.inert_tensors``) for export,
        as its values are (bfloat16 as float32, which holds it exactly)."""
        data = np.asarray(array)
        if data.dtype not in (np.float16, np.float32, np.float64):
            data = data.astype(np.float32)
        with writing(self._out.path):
            self._file.require_group(INERT_GROUP).create_dataset(name, data=data)

    def _close_and_discard(self) -> None:
        if self._file is not None:
            with quiet_deallocation():
                try:
                    self._file.close()
                except Exception:     # a full disk fails the close's flush too
                    pass
        self._out.discard()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._close_and_discard()
            if is_write_failure(exc):
                raise write_failure(self._out.path, exc) from None
            return
        try:
            with writing(self._out.path):
                self._file.close()
        except WriteError:
            self._out.discard()
            raise
        missing = [n for n in self.expected if n not in self.written]
        if missing:
            self._out.discard()
            raise HpcparError(f"{self._out.path}: {len(missing)} tensor(s) never written, "
                              f"first {missing[0]}")
        with writing(self._out.path):
            self._out.commit()
