"""The HDF5 checkpoint format (docs/design.md §4), version 1.

    /                                   attrs: hpcpar_format_version = 1
                                               hf_config = the model's config.json (JSON text)
                                               dtype = "float32" | "float16" | "bfloat16"
    /model.embed_tokens.weight          one dataset per tensor, Hugging Face name and
    /model.layers.0.self_attn.q_proj.weight        orientation ([out_features, in_features])
    ...
    /tokenizer/tokenizer.json           tokenizer files kept with the model, as raw bytes (uint8)

bfloat16, which HDF5 has no type for, is stored as its raw 16 bits (uint16) with the dataset
attribute ``dtype = "bfloat16"``. Datasets are chunked so that the slice any rank reads for
tp in {1, 2, 4, 8} is a whole number of chunks (``chunk_shape``), and are not compressed, so a
rank's read is a direct copy of its chunks into its buffer.
"""

from __future__ import annotations

from math import gcd

import numpy as np

from ..models.config import ModelConfig
from ..models.sharding import ShardingError, piece_of, placement_of
from ..models.tensors import TensorSpec, model_tensors
from ..parallel.device.dtypes import bfloat16
from ..parallel.tensor.placement import Shard

FORMAT_VERSION = 1
ATTR_VERSION = "hpcpar_format_version"
ATTR_CONFIG = "hf_config"
ATTR_DTYPE = "dtype"
TOKENIZER_GROUP = "tokenizer"
# the source's tensors that compute nothing (``models.tensors.inert_tensors``), kept for export
INERT_GROUP = "inert"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")

CHUNK_TP_SIZES = (1, 2, 4, 8)
CHUNK_BYTES = 2 << 20  # ~2 MiB: large enough for fast reads, small enough to cut evenly


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """What HDF5 holds for a tensor of ``dtype`` (bfloat16 travels as uint16)."""
    return np.dtype(np.uint16) if np.dtype(dtype) == bfloat16 else np.dtype(dtype)


def to_storage(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == bfloat16 else a


def logical_dtype(dset) -> np.dtype:
    """The dtype a dataset represents (bfloat16 for marked uint16 data)."""
    if dset.attrs.get(ATTR_DTYPE) == "bfloat16":
        return bfloat16
    return dset.dtype


def _largest_divisor_at_most(n: int, cap: int) -> int:
    cap = max(1, min(n, cap))
    for d in range(cap, 0, -1):
        if n % d == 0:
            return d
    return 1


def split_boundaries(spec: TensorSpec, cfg: ModelConfig,
                     tp_sizes=CHUNK_TP_SIZES) -> tuple[int | None, list[int]]:
    """(split axis, every offset where some rank's slice starts or ends for ``tp_sizes``);
    tp sizes the model cannot use are skipped. Axis None: the tensor is never split. A fused
    tensor's offsets are its parts', each shifted to where the part starts."""
    if spec.role == "fused":
        edges = {0, spec.shape[0]}
        for part in model_tensors(cfg):
            if part.stored == spec.name:
                edges.update(part.offset + e for e in split_boundaries(part, cfg, tp_sizes)[1])
        return 0, sorted(edges)
    placement = placement_of(spec, cfg)
    if not isinstance(placement, Shard):
        return None, []
    axis = placement.dim
    edges = {0, spec.shape[axis]}
    for tp in tp_sizes:
        try:
            pieces = [piece_of(spec, cfg, r, tp).source[axis] for r in range(tp)]
        except ShardingError:
            continue
        edges.update(p for s in pieces for p in (s.start, s.stop))
    return axis, sorted(edges)


def chunk_shape(spec: TensorSpec, cfg: ModelConfig, itemsize: int,
                budget: int = CHUNK_BYTES) -> tuple[int, ...]:
    """A chunk shape whose length along the split axis divides every slice boundary, so each
    rank's slice is whole chunks; the other dimension stays whole when a line of it fits the
    byte budget."""
    max_items = max(1, budget // itemsize)
    axis, edges = split_boundaries(spec, cfg)
    if axis is None:  # never split: norms and row-parallel biases, all 1-D
        return tuple(min(d, max_items) for d in spec.shape)
    step = 0
    for e in edges:
        step = gcd(step, e)
    if len(spec.shape) == 1:
        return (_largest_divisor_at_most(step, max_items),)
    other = 1 - axis
    chunk = [0, 0]
    chunk[other] = min(spec.shape[other], max_items)
    chunk[axis] = _largest_divisor_at_most(step, max_items // chunk[other])
    return tuple(chunk)
