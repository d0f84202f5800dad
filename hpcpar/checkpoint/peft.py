"""LoRA adapters as peft's folders (``PeftModel.from_pretrained`` loads them, and
``save_pretrained`` writes them):

    DIR/adapter_config.json          LoraConfig's fields: peft_type LORA, task_type
                                     CAUSAL_LM, r, lora_alpha, target_modules (module names:
                                     q_proj, ...), base_model_name_or_path, ...
    DIR/adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in] and
                                     ...lora_B.weight [out, r], float32

hpcpar's adapter tensors are named ``<module>.lora_A.weight`` (``models.lora``): the file's
names less ``base_model.model.``. A mixture's experts are peft's ``target_parameters``
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``): per layer one A [r E, in] and one
B [out, r E] of all its experts (expert e's A the rows e r .. e r + r - 1, its B the columns
e, e + E, ...), named ``...mlp.experts.lora_A.weight``; with both targeted, gate_up's is
the inner wrapper's, ``...mlp.experts.base_layer.lora_A.weight``.

Reading refuses, in one line each, what hpcpar's LoRA is not: rslora, DoRA, per-module ranks
or alphas, biases, extra modules or embedding rows trained, parameters other than a
mixture's experts, a subset of layers, a target_modules pattern (a string) or module hpcpar
does not adapt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..models.config import ModelConfig
from ..models.lora import (EXPERT_MODULES, EXPERT_TARGETS, TARGETS, LoraSettings, module_leaf,
                           target_problems)
from ..parallel.errors import HpcparError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def peft_config(cfg: ModelConfig, settings: LoraSettings, base: str) -> dict:
    """adapter_config.json as peft's ``LoraConfig.save_pretrained`` writes it."""
    return {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None, "loftq_config": {},
        "lora_alpha": int(settings.alpha) if float(settings.alpha).is_integer() else settings.alpha,
        "lora_dropout": 0.0, "megatron_config": None, "megatron_core": "megatron.core",
        "modules_to_save": None, "peft_type": "LORA", "r": settings.rank,
        "rank_pattern": {}, "revision": None,
        "target_modules": sorted(module_leaf(cfg, t) for t in settings.targets
                                 if t not in EXPERT_TARGETS),
        "target_parameters": [EXPERT_MODULES[t] for t in EXPERT_TARGETS
                              if t in settings.targets] or None,
        "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False,
    }


def _stacked_names(settings: LoraSettings, layer: int) -> dict[str, str]:
    """Each expert target's name prefix in peft's file for ``layer`` (less ``.lora_A.weight``):
    ``model.layers.{i}.mlp.experts``, gate_up's ``...experts.base_layer`` when down is
    targeted too (peft wraps gate_up first, down around it)."""
    module = f"model.layers.{layer}.mlp.experts"
    both = all(t in settings.targets for t in EXPERT_TARGETS)
    return {"experts.gate_up": f"{module}.base_layer" if both else module,
            "experts.down": module}


def to_peft(cfg: ModelConfig, settings: LoraSettings, tensors: dict) -> dict[str, np.ndarray]:
    """hpcpar's adapter tensors (by its names, every expert's) as peft's file holds them:
    the experts' stacked per layer and target."""
    from ..models.lora import adapter_specs
    specs = adapter_specs(cfg, range(cfg.num_hidden_layers), settings)
    out = {PREFIX + s.name: tensors[s.name] for s in specs if s.expert is None}
    r, E = settings.rank, cfg.num_experts
    for i in cfg.moe_layers:
        for t, prefix in _stacked_names(settings, i).items():
            if t not in settings.targets:
                continue
            mine = [s for s in specs if s.layer == i and s.target == t]
            a = np.concatenate([tensors[s.name] for s in mine if s.half == "A"])
            b_parts = [np.concatenate([tensors[s.name] for s in mine
                                       if s.half == "B" and s.expert == e]) for e in range(E)]
            b = np.stack(b_parts, axis=-1).reshape(b_parts[0].shape[0], r * E)  # [out, r, E]
            out[f"{PREFIX}{prefix}.lora_A.weight"] = a
            out[f"{PREFIX}{prefix}.lora_B.weight"] = b
    return out


def from_peft(cfg: ModelConfig, settings: LoraSettings, tensors: dict, where: str) -> dict:
    """peft's file's tensors (by its names) as hpcpar's: each expert's cut from its layer's
    stacked ones, whose shapes are checked here (one error naming a tensor of another shape);
    the rest is checked against the model by ``check_adapter``."""
    from ..models.lora import adapter_specs
    out = {}
    for name, a in tensors.items():
        if not name.startswith(PREFIX):
            raise HpcparError(f"{where}: tensor {name} of {WEIGHTS} is not named "
                              f"{PREFIX}<module>.lora_A/B.weight as peft names them")
        out[name[len(PREFIX):]] = a
    r, E = settings.rank, cfg.num_experts
    specs = adapter_specs(cfg, range(cfg.num_hidden_layers), settings)
    for i in cfg.moe_layers:
        for t, prefix in _stacked_names(settings, i).items():
            if t not in settings.targets:
                continue
            mine = [s for s in specs if s.layer == i and s.target == t]
            a_in = next(s for s in mine if s.half == "A").shape[1]
            b_out = sum(s.shape[0] for s in mine if s.half == "B" and s.expert == 0)
            a, b = (out.pop(f"{prefix}.lora_{h}.weight", None) for h in "AB")
            for half, got, want in (("A", a, (r * E, a_in)), ("B", b, (b_out, r * E))):
                if got is None or tuple(got.shape) != want:
                    raise HpcparError(
                        f"{where}: the adapter's {PREFIX}{prefix}.lora_{half}.weight is "
                        f"{'missing' if got is None else tuple(got.shape)} (the model's: "
                        f"{want}, {EXPERT_MODULES[t]} of {E} experts at rank {r}); is it an "
                        f"adapter of this checkpoint's model ({cfg.model_type})?")
            a, b = a.reshape(E, r, a_in), b.reshape(b_out, r, E)
            for s in mine:
                e = s.expert
                if s.half == "A":
                    out[s.name] = np.ascontiguousarray(a[e])
                else:                    # the gate's rows of B_e, then the up's
                    rows = [x for x in mine if x.half == "B" and x.expert == e]
                    start = sum(x.shape[0] for x in rows[:rows.index(s)])
                    out[s.name] = np.ascontiguousarray(b[start:start + s.shape[0], :, e])
    return out


def write_adapter(folder: Path, cfg: ModelConfig, settings: LoraSettings, base: str,
                  tensors: dict[str, np.ndarray]) -> list[Path]:
    """The two files into ``folder`` (which exists); ``tensors`` by hpcpar's names."""
    config = folder / CONFIG
    config.write_text(json.dumps(peft_config(cfg, settings, base), indent=2) + "\n")
    weights = folder / WEIGHTS
    header, offset, blobs = {}, 0, []
    tensors = to_peft(cfg, settings, tensors)
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(weights, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for blob in blobs:
            out.write(blob)
    return [config, weights]


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (float32, float16 or float64), as float32."""
    data = path.read_bytes()
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise HpcparError(f"{path}: tensor {name} is {entry['dtype']}; adapters are "
                                  "read in F32, F16 or F64")
            a, b = entry["data_offsets"]
            out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=dtype).reshape(
                entry["shape"]).astype(np.float32)
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise HpcparError(f"{path}: not a readable safetensors file ({e})") from None


def read_adapter(folder: Path, cfg: ModelConfig,
                 flag: str = "--lora-from") -> tuple[LoraSettings, dict[str, np.ndarray]]:
    """A peft LoRA folder for ``cfg``'s model: its settings and its tensors by hpcpar's
    names (checked against the model's shapes by the caller); ``flag`` names it in errors."""
    folder = Path(folder)
    where = f"{flag} {folder}"
    config = _adapter_config(folder, where)
    problems = _untrained_options(config)
    parameters = config.get("target_parameters") or []
    by_parameter = {m: t for t, m in EXPERT_MODULES.items()} if cfg.moe_layers else {}
    if not isinstance(parameters, list) or any(p not in by_parameter for p in parameters):
        problems.append(f"target_parameters {parameters!r} (hpcpar adapts "
                        f"{', '.join(by_parameter) or 'none of this model'})")
        parameters = []
    modules = config.get("target_modules")
    from ..models import family_of
    named = family_of(cfg.model_type).names           # DeepSeek's latent attention: no q, k, v
    by_leaf = {module_leaf(cfg, t): t for t in TARGETS if t not in EXPERT_TARGETS
               and t in named}
    if modules is None and parameters:
        modules = []
    if not isinstance(modules, list):
        problems.append(f"target_modules {modules!r} (a list of module names: "
                        f"{', '.join(by_leaf)})")
        modules = []
    unknown = [m for m in modules if m not in by_leaf]
    if unknown:
        problems.append(f"target_modules {', '.join(unknown)} (hpcpar adapts "
                        f"{', '.join(by_leaf)})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"r {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        problems.append(f"lora_alpha {alpha!r}")
    if problems:
        raise HpcparError(f"{where}: {CONFIG} has {'; '.join(problems)}, which hpcpar's LoRA "
                          "does not train")
    targets = tuple(t for t in TARGETS if t in EXPERT_TARGETS and EXPERT_MODULES[t] in
                    parameters or t in by_leaf.values() and module_leaf(cfg, t) in modules)
    settings = LoraSettings(rank, float(alpha), targets)
    problems = target_problems(cfg, targets, rank)
    if problems:
        raise HpcparError(f"{where}: {'; '.join(problems)}")
    return settings, from_peft(cfg, settings, read_safetensors(folder / WEIGHTS), where)


def _adapter_config(folder: Path, where: str) -> dict:
    """The folder's adapter_config.json, refused in one line where it is not a peft
    adapter's."""
    if not folder.is_dir():
        raise HpcparError(f"{where}: not a folder; give a peft adapter folder (with {CONFIG} "
                          f"and {WEIGHTS})")
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise HpcparError(f"{where}: no {name}; a peft LoRA adapter folder holds "
                              f"{CONFIG} and {WEIGHTS} (PeftModel.save_pretrained)")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise HpcparError(f"{where}: {CONFIG} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise HpcparError(f"{where}: {CONFIG} is not a JSON object")
    return config


def _untrained_options(config: dict) -> list[str]:
    """The peft options an adapter config sets that hpcpar's LoRA does not train."""
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (LORA only)")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(key):
            problems.append(f"{key} true")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            problems.append(f"a {key} (one rank and alpha for every module)")
    for key in ("layers_to_transform", "modules_to_save", "layer_replication"):
        if config.get(key):
            problems.append(f"{key} {config.get(key)!r}")
    if config.get("bias", "none") != "none":
        problems.append(f"bias {config.get('bias')!r} (none only)")
    if config.get("lora_bias"):
        problems.append("lora_bias true")
    if config.get("trainable_token_indices"):
        problems.append("trainable_token_indices (embedding rows trained)")
    return problems


# ---- a LoRA run's checkpoint out: a peft folder, or its base with the adapter merged ---------

def run_settings(path) -> tuple[LoraSettings, str] | None:
    """The LoRA settings and base checkpoint a training checkpoint's ``train`` attributes
    name (None: not a LoRA run's checkpoint, or no checkpoint)."""
    import h5py
    path = Path(path)
    if not path.is_file() or not h5py.is_hdf5(path):
        return None
    try:
        with h5py.File(path, "r", locking=False) as f:
            group = f.get("train")
            attrs = dict(group.attrs) if isinstance(group, h5py.Group) else {}
    except OSError:
        return None
    if "lora_rank" not in attrs:
        return None
    return (LoraSettings(int(attrs["lora_rank"]), float(attrs["lora_alpha"]),
                         tuple(json.loads(attrs["lora_targets"]))), str(attrs["lora_base"]))


def open_run_checkpoint(path):
    """A LoRA run's checkpoint (its adapters and their optimizer state, no base) as a
    ``Checkpoint`` whose tensors are the adapters; None when ``path`` is not one."""
    import h5py
    from ..models.lora import adapter_specs
    from .format import ATTR_CONFIG, ATTR_VERSION
    from .parts import check_parts
    from .reader import Checkpoint, CheckpointError
    found = run_settings(path)
    if found is None:
        return None
    path = Path(path)
    with h5py.File(path, "r", locking=False) as f:
        problem = check_parts(path, f)
        if problem:
            raise CheckpointError(problem)
        hf_config = json.loads(f.attrs[ATTR_CONFIG])
        version = int(f.attrs[ATTR_VERSION])
        config = ModelConfig.from_hf(hf_config, source=f"{path} config")
        specs = {s.name: s for s in adapter_specs(config, range(config.num_hidden_layers),
                                                   found[0])}
        for name, spec in specs.items():
            dset = f.get(name)
            if not isinstance(dset, h5py.Dataset) or dset.shape != spec.shape:
                raise CheckpointError(f"{path}: the LoRA run's tensor {name} is missing or "
                                      f"not of shape {spec.shape}")
    return Checkpoint(path, config, hf_config, np.dtype(np.float32), version, specs)


def _adapters(ckpt, settings: LoraSettings) -> dict[str, np.ndarray]:
    from ..models.lora import adapter_specs
    from .reader import load_shard
    specs = adapter_specs(ckpt.config, range(ckpt.config.num_hidden_layers), settings)
    return load_shard(ckpt, specs, dtype=np.float32).tensors


def _lora_run(checkpoint, flag: str):
    """(the checkpoint, its LoRA settings, its base's path) of a LoRA run's checkpoint, or
    one line saying it is not one."""
    ckpt = open_run_checkpoint(checkpoint)
    found = run_settings(checkpoint)
    if found is None:
        raise HpcparError(f"{flag}: {checkpoint} is not a LoRA run's checkpoint (its train "
                          f"attributes name no LoRA rank); export it without {flag}")
    return (ckpt, *found)


def export_adapter(checkpoint, out_dir) -> list[Path]:
    """A LoRA run's checkpoint as a peft adapter folder ``out_dir``, written beside it and
    renamed into place, as ``export`` writes its folders."""
    from .export import _check_target, _remove_dead_temporaries, _write_in_place
    from .files import OutputLock
    ckpt, settings, base = _lora_run(checkpoint, "--lora")
    name = ckpt.hf_config.get("_name_or_path") or base
    tensors = _adapters(ckpt, settings)
    _check_target(Path(out_dir))
    out_dir = Path(out_dir).resolve()
    with OutputLock(out_dir, beside=True):
        _check_target(out_dir)
        _remove_dead_temporaries(out_dir)
        written = _write_in_place(out_dir, lambda tmp: write_adapter(
            tmp, ckpt.config, settings, name, tensors))
    return [out_dir / p.name for p in written]


def merged_export_args(checkpoint) -> tuple[Path, dict]:
    """For ``export --merge-lora``: the base checkpoint a LoRA run's checkpoint names, and
    by base tensor name what merging adds to it, s B A (float32)."""
    from ..models.lora import adapter_pairs, adapter_specs
    ckpt, settings, base = _lora_run(checkpoint, "--merge-lora")
    if not Path(base).is_file():
        raise HpcparError(f"--merge-lora: the run's base checkpoint {base} is not there; put "
                          "it back at that path to merge the adapter into it")
    tensors = _adapters(ckpt, settings)
    specs = adapter_specs(ckpt.config, range(ckpt.config.num_hidden_layers), settings)
    add = {}
    for a, b in adapter_pairs(specs):
        A, B = tensors[a.name], tensors[b.name]
        add[b.base] = (lambda A=A, B=B: np.float32(settings.scale) * (B @ A))
    return Path(base), add


# ---- an adapter applied at load (generate, score --lora) ----------------------------------

def check_adapter(cfg: ModelConfig, settings: LoraSettings, tensors: dict, where: str) -> None:
    """``tensors`` (by hpcpar's names) are exactly the adapters ``settings`` give ``cfg``'s
    model, each of its shape: one error naming what is not."""
    from ..models.lora import adapter_specs, target_problems
    problems = target_problems(cfg, settings.targets, settings.rank)
    if problems:
        raise HpcparError(f"{where}: {'; '.join(problems)}")
    want = {s.name: s.shape for s in adapter_specs(cfg, range(cfg.num_hidden_layers), settings)}
    missing = [n for n in want if n not in tensors]
    extra = [n for n in tensors if n not in want]
    wrong = [f"{n} {tuple(tensors[n].shape)} (the model's: {want[n]})" for n in want
             if n in tensors and tuple(tensors[n].shape) != want[n]]
    for what, names in (("lacks", missing), ("has tensors this model has no place for:",
                                              extra), ("has shapes of another model:", wrong)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise HpcparError(f"{where}: the adapter {what} {', '.join(names[:3])}{more}; is "
                              f"it an adapter of this checkpoint's model ({cfg.model_type})?")


def load_adapter(source, cfg: ModelConfig) -> tuple[LoraSettings, dict[str, np.ndarray]]:
    """An adapter for ``cfg``'s model from ``source``: a peft folder, an hpcpar LoRA run's
    checkpoint, or its run folder (its ``latest``); whole float32 tensors by hpcpar's names,
    checked against the model."""
    source, where = Path(source), f"--lora {source}"
    if source.is_dir() and (source / "latest").is_file():
        source = source / (source / "latest").read_text().strip()
    if source.is_dir():
        settings, tensors = read_adapter(source, cfg, "--lora")
    else:
        ckpt = open_run_checkpoint(source)
        if ckpt is None:
            raise HpcparError(f"{where}: neither a peft adapter folder ({CONFIG}, {WEIGHTS}) "
                              "nor an hpcpar LoRA run's checkpoint or folder")
        settings = run_settings(source)[0]
        tensors = _adapters(ckpt, settings)
    check_adapter(cfg, settings, tensors, where)
    return settings, tensors


def adapter_digest(source, cfg: ModelConfig) -> str:
    """The sha256 of the adapter ``source`` as generate and score apply it (its rank, alpha,
    targets and tensors): what a resumed generation must share with the stopped run, so
    that no output holds rows of two adapters."""
    import hashlib
    settings, tensors = load_adapter(source, cfg)
    digest = hashlib.sha256(json.dumps([settings.rank, settings.alpha,
                                        list(settings.targets)]).encode())
    for name in sorted(tensors):
        digest.update(name.encode() + b"|")
        digest.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return digest.hexdigest()


def merge_adapter(tensors: dict, cfg: ModelConfig, settings: LoraSettings, adapters: dict,
                  tp_rank: int, tp_size: int, backend) -> None:
    """Merge the adapter into this rank's loaded slices ``tensors`` (by name, in place):
    W_i += s B_i A_i, the pieces of A and B this rank's slice of W takes (``models.lora``'s
    split), in float32, then rounded to W's dtype. Exactly the model with the adapter, up to
    that rounding: generation and scoring need no adapter code of their own."""
    from ..models.lora import adapter_pairs, adapter_specs
    from ..models.sharding import piece_of
    specs = adapter_specs(cfg, range(cfg.num_hidden_layers), settings)
    for a, b in adapter_pairs(specs):
        if b.base not in tensors:
            continue
        pieces = []
        for spec in (a, b):
            piece = piece_of(spec, cfg, tp_rank, tp_size)
            local = np.zeros(piece.shape, np.float32)
            local[piece.dest] = adapters[spec.name][piece.source]
            pieces.append(local)
        w = tensors[b.base]
        delta = backend.asarray(np.float32(settings.scale) * (pieces[1] @ pieces[0]))
        w[...] = (w.astype(np.float32) + delta).astype(w.dtype)


def apply_adapter(source, cfg: ModelConfig, tensors: dict, tp_rank: int, tp_size: int,
                  backend) -> None:
    """``load_adapter(source)`` merged into this rank's slices (``merge_adapter``)."""
    settings, adapters = load_adapter(source, cfg)
    merge_adapter(tensors, cfg, settings, adapters, tp_rank, tp_size, backend)
