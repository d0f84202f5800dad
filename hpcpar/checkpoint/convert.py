"""Hugging Face folder (config.json + safetensors) -> hpcpar HDF5 checkpoint.

Conversion is a copy: same tensor names, same orientation, optionally a new dtype. Tensors are
read and written one at a time (safetensors maps the files; nothing holds the whole model), and
the tokenizer files travel inside the checkpoint so text prompts work later.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path, PurePosixPath

import numpy as np

from ..models import family_of
from ..models.config import ModelConfig
from ..models.tensors import inert_tensors, stored_tensors
from ..parallel.device.dtypes import FLOAT_DTYPES, float_dtype
from ..parallel.errors import HpcparError
from .files import OutputLock, check_output
from .format import TOKENIZER_FILES
from .writer import CheckpointWriter

# Tensors some Llama checkpoints carry that the computation does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' names of the floating-point types hpcpar converts; any other (I8, U8, F8_E4M3,
# ...: quantized weights, whose values mean nothing without their scales) is refused, never cast
_FLOAT_CODES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError:
        raise HpcparError("'hpcpar convert' needs safetensors: in the clone of hpcpar, pip "
                          "install -e \".[hf]\" (or pip install 'safetensors>=0.4')") from None
    return safe_open


def weight_map(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded index)."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.exists():
        return {name: _shard_path(hf_dir, index, file)
                for name, file in _index_entries(index).items()}
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


def _index_entries(index: Path) -> dict[str, str]:
    """The index's weight_map, tensor name -> file name, or one error saying what is wrong."""
    try:
        data = json.loads(index.read_bytes())
    except (OSError, ValueError) as e:                 # UnicodeDecodeError is a ValueError
        raise HpcparError(f"{index}: not a readable safetensors index ({_first_line(e)}); "
                          "download it again") from None
    if not isinstance(data, dict):
        raise HpcparError(f"{index}: holds a JSON {_kind(data)}, not an object with a "
                          "weight_map; not a safetensors index")
    if "weight_map" not in data:
        raise HpcparError(f"{index}: not a safetensors index ('weight_map' is missing)")
    entries = data["weight_map"]
    if not isinstance(entries, dict):
        raise HpcparError(f"{index}: its weight_map is a JSON {_kind(entries)}, not an object "
                          "of tensor name -> shard file")
    bad = next(((n, f) for n, f in entries.items() if not isinstance(f, str) or not f), None)
    if bad:
        raise HpcparError(f"{index}: its weight_map gives tensor {bad[0]} the file {bad[1]!r}, "
                          "not a file name")
    return entries


def _shard_path(hf_dir: Path, index: Path, file: str) -> Path:
    """The shard ``file`` names, inside ``hf_dir``: an absolute path or one through '..'
    would read a file of another folder (shards are links into a cache in Hugging Face's
    own download folders, so the check is on the name, not on where a link leads)."""
    name = PurePosixPath(file)
    if name.is_absolute() or ".." in name.parts:
        raise HpcparError(f"{index}: names the shard {file!r}, outside the model folder; an "
                          "index names files beside it")
    return hf_dir / name


def _shard_tensors(files: dict[str, Path], index: Path) -> dict[str, tuple[str, tuple]]:
    """Name -> (safetensors dtype code, shape) of every tensor ``files`` maps, read from the
    shards' headers; a shard that does not open (truncated, damaged) or does not hold a
    tensor the index gives it is one error naming it."""
    safe_open = _safetensors()
    out: dict[str, tuple[str, tuple]] = {}
    for shard in sorted(set(files.values())):
        try:
            with safe_open(shard, framework="numpy") as f:
                held = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                        for n in f.keys()}
        except Exception as e:                          # SafetensorError, OSError
            raise HpcparError(f"{shard}: not a readable safetensors file, truncated or "
                              f"damaged ({_first_line(e)}); download it again") from None
        for name in (n for n, p in files.items() if p == shard):
            if name not in held:
                raise HpcparError(f"{index}: gives tensor {name} to {shard.name}, which does "
                                  "not hold it; download the index and its shards again")
            out[name] = held[name]
    return out


def check_generation_config(hf_dir: Path) -> None:
    """generation_config.json, where there is one, is a JSON object whose eos_token_id (the
    one field generation reads) is an id, a list of ids or null: else one error naming it."""
    path = hf_dir / "generation_config.json"
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise HpcparError(f"{path} is not valid JSON ({_first_line(e)}); repair or download it "
                          "again, or move it out of the folder to convert without it") from None
    if not isinstance(data, dict):
        raise HpcparError(f"{path} holds a JSON {_kind(data)}, not an object; repair or "
                          "download it again, or move it out of the folder")
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HpcparError(f"{path}: eos_token_id {eos!r} is not a token id or a list of them")


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_tokenizer_files(hf_dir: Path) -> None:
    """The tokenizer files the checkpoint will keep can be used: tokenizer.json loads with the
    tokenizers library, the chat template is UTF-8 text that compiles (and the JSON it sits in
    parses). A damaged one is one error naming it; without it the model converts, for token
    ids (and text, without a chat template)."""
    from ..models.chat import ChatTemplate  # the jobs' own readers
    from ..models.tokenizer import StoredTokenizer
    files = {n: (hf_dir / n).read_bytes() for n in TOKENIZER_FILES if (hf_dir / n).is_file()}
    fix = "; repair or download it again, or move it out of the folder to convert without it"
    if "tokenizer.json" in files:
        why = StoredTokenizer(files["tokenizer.json"]).problem()
        if why:
            raise HpcparError(f"{hf_dir / 'tokenizer.json'} {why}{fix}")
    chat = ChatTemplate.from_files(files, folder=hf_dir)
    why = chat.check() if chat is not None else None
    if why:
        raise HpcparError(f"{chat.origin} {why}{fix}")


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
    inert = {n: shape for n, shape in inert_tensors(cfg).items() if n in files}
    family = family_of(cfg.model_type)
    unexpected = [n for n in files if n not in expected and n not in inert
                  and not n.endswith(_IGNORED_SUFFIXES) and not family.ignores(n)
                  and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if unexpected:
        raise HpcparError(f"{hf_dir}: tensor {unexpected[0]} (and {len(unexpected) - 1} more) "
                          f"is not part of a {cfg.model_type} model; does config.json's "
                          "model_type match these weights?")

    shards = sorted(set(files[n] for n in [*expected, *inert]))
    absent = [p for p in shards if not p.is_file()]
    if absent:
        raise HpcparError(f"{hf_dir}: the index names {absent[0].name}, which is not in the "
                          "folder; download every shard the index lists")
    held = _shard_tensors({n: files[n] for n in [*expected, *inert]},
                          hf_dir / "model.safetensors.index.json")
    for name, want in [*((s.name, s.shape) for s in specs), *inert.items()]:
        code, shape = held[name]
        if code not in _FLOAT_CODES:
            raise HpcparError(f"{files[name]}: tensor {name} is {code}, not a "
                              f"floating-point type ({', '.join(FLOAT_DTYPES)}); quantized "
                              "weights are not converted (casting would lose their scales): "
                              "convert the unquantized model")
        if shape != want:
            raise HpcparError(f"{files[name]}: {name}: shape {shape} does not match "
                              f"the config, which implies {want}")
    check_generation_config(hf_dir)
    check_tokenizer_files(hf_dir)
    sources = [config_path, *shards, *(hf_dir / n for n in TOKENIZER_FILES)]
    check_output(out, {f"source file {p.name}": p for p in sources}, kind="checkpoint")

    safe_open = _safetensors()
    target = float_dtype(dtype or _FLOAT_CODES[held[specs[0].name][0]])
    with ExitStack() as stack:
        stack.enter_context(OutputLock(out))
        handles = {p: stack.enter_context(safe_open(p, framework="numpy")) for p in shards}
        with CheckpointWriter(out, hf_config, target, source=str(hf_dir)) as w:
            for spec in specs:
                w.write(spec, _read(handles[files[spec.name]], files[spec.name], spec.name))
            for name in inert:
                w.keep_inert(name, _read(handles[files[name]], files[name], name))
            for name in TOKENIZER_FILES:
                if (hf_dir / name).exists():
                    w.add_file(name, (hf_dir / name).read_bytes())
    return cfg


def _read(handle, shard: Path, name: str) -> np.ndarray:
    """One tensor of an open shard; a read that fails (the file changed or is damaged past
    its header) is one error naming both."""
    try:
        return handle.get_tensor(name)
    except Exception as e:                              # SafetensorError, OSError
        raise HpcparError(f"{shard}: reading tensor {name} failed ({_first_line(e)}); "
                          "download the file again") from None
