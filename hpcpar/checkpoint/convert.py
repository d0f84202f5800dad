"""Hugging Face folder (config.json + safetensors) -> hpcpar HDF5 checkpoint.

Conversion is a copy: same tensor names, same orientation, optionally a new dtype. Tensors are
read and written one at a time (safetensors maps the files; nothing holds the whole model), and
the tokenizer files travel inside the checkpoint so text prompts work later.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..dtypes import float_dtype
from ..errors import HpcparError
from ..outputs import OutputLock, check_output
from ..tensors import stored_tensors
from .format import TOKENIZER_FILES
from .writer import CheckpointWriter

# Tensors some Llama checkpoints carry that the computation does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError:
        raise HpcparError("'hpcpar convert' needs safetensors: pip install 'hpcpar[hf]'") from None
    return safe_open


def weight_map(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded index)."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.exists():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HpcparError(f"{index}: not a safetensors index ({e})") from None
        return {name: hf_dir / file for name, file in entries.items()}
    if single.exists():
        safe_open = _safetensors()
        try:
            with safe_open(single, framework="numpy") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise HpcparError(f"{single}: not a readable safetensors file ({e})") from None
    if any(hf_dir.glob("*.bin")):
        raise HpcparError(f"{hf_dir}: only PyTorch .bin weights found; hpcpar reads safetensors "
                          "(pickle can run code). Re-save with save_pretrained(..., "
                          "safe_serialization=True)")
    raise HpcparError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def convert(hf_dir: str | Path, out: str | Path, dtype: str | None = None) -> ModelConfig:
    """Convert a Hugging Face folder of a supported family; ``dtype`` defaults to the weights'
    own."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HpcparError(f"{hf_dir}: not a folder; pass the Hugging Face model folder "
                          "(config.json and *.safetensors)")
    config_path = hf_dir / "config.json"
    cfg = ModelConfig.from_json_file(config_path)
    hf_config = json.loads(config_path.read_text())
    files = weight_map(hf_dir)
    specs = stored_tensors(cfg)
    expected = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in files]
    if missing:
        raise HpcparError(f"{hf_dir}: {len(missing)} tensor(s) the config needs are missing, "
                          f"first {missing[0]}")
    unexpected = [n for n in files if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if unexpected:
        raise HpcparError(f"{hf_dir}: tensor {unexpected[0]} (and {len(unexpected) - 1} more) "
                          f"is not part of a {cfg.model_type} model; does config.json's "
                          "model_type match these weights?")

    shards = sorted(set(files[n] for n in expected))
    absent = [p for p in shards if not p.is_file()]
    if absent:
        raise HpcparError(f"{hf_dir}: the index names {absent[0].name}, which is not in the "
                          "folder; download every shard the index lists")
    sources = [config_path, *shards, *(hf_dir / n for n in TOKENIZER_FILES)]
    check_output(out, {f"source file {p.name}": p for p in sources}, kind="checkpoint")

    safe_open = _safetensors()
    with ExitStack() as stack:
        stack.enter_context(OutputLock(out))
        handles = {p: stack.enter_context(safe_open(p, framework="numpy")) for p in shards}
        first = handles[files[specs[0].name]].get_tensor(specs[0].name)
        target = float_dtype(dtype) if dtype else np.dtype(first.dtype)
        with CheckpointWriter(out, hf_config, target, source=str(hf_dir)) as w:
            for spec in specs:
                w.write(spec, handles[files[spec.name]].get_tensor(spec.name))
            for name in TOKENIZER_FILES:
                if (hf_dir / name).exists():
                    w.add_file(name, (hf_dir / name).read_bytes())
    return cfg
