"""Job files: TOML whose sections mirror the command-line flags, as typed dataclasses.

    [model]     checkpoint = "llama.h5"     (or "preset:tiny", a cached random model)
                dtype = "float32"           compute dtype
    [parallel]  dp, pp, tp (absent: inferred), micro_batches, schedule, stage_layers,
                backend, comm
    [data]      prompts = "prompts.jsonl"   (.npy, .jsonl, or "random" with random_count,
                                             random_lengths = [min, max], random_seed)
                dataset = "tokens.bin"      training data (.npy rows, .bin, .jsonl, or
                                             "synthetic", generated)
    [generate]  max_new_tokens, temperature, top_k, top_p, min_p, seed, repetition_penalty,
                presence_penalty, frequency_penalty, min_tokens, n, logprobs, prompt_logprobs,
                stop_at_eos, stop (strings), stop_token_ids,
                save_logits,
                batching ("continuous" or "static"), batch_size (rows in flight per
                micro-batch; 0: what fits), cuda_graphs (decode steps replayed as CUDA
                graphs), prefix_cache (prompts that begin alike share their keys),
                kv_block_size (positions per block of the paged KV cache), kv_memory
                (its size: a fraction of the free memory up to 1, bytes above)
    [train]     steps, global_batch, seq_len, optimizer, lr, ... (the train flags)
    [score]     data = "texts.jsonl"        sequences to score (.npy ids left-padded with
                                             negative ids, or .jsonl of {ids} / {text}),
                prefix_cache (rows that begin alike compute their beginning once)
    [output]    path = "out.h5" (generation) or a folder (training)
                trace = "trace.json"        a timeline of every rank (Chrome trace format)

Later sources win: the file, then ``--set section.key=value``, then explicit flags. Input
paths in a file (checkpoint, prompts) are relative to the file, so a job runs from anywhere;
the output path, and every path on the command line, to the working directory.
Unknown sections or keys and values of the wrong type are errors that name them.
"""

from __future__ import annotations

import difflib

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from ..parallel.errors import HpcparError
from ..parallel.optim.settings import OptimizerSettings
from . import settings
from .layout import ParallelConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_PREFIX = "preset:"


class JobError(HpcparError):
    pass


@dataclass(frozen=True)
class ModelSection:
    checkpoint: str = PRESET_PREFIX + "tiny"
    dtype: str = "float32"
    lora: str | None = None     # generate/score: a LoRA adapter (peft folder or hpcpar run)


@dataclass(frozen=True)
class ParallelSection:
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    cp: int = 1                        # context parallelism: each sequence split over cp ranks
    ep: int = 1                        # expert parallelism: experts split over ep dp replicas
    micro_batches: int = 1
    schedule: str | None = None        # generation: gpipe; training: 1f1b
    virtual_stages: int = 1            # model chunks per stage (interleaved schedule)
    stage_layers: tuple[int, ...] | None = None
    backend: str = "auto"
    comm: str = "auto"
    timeout: float = 600.0             # seconds a receive or collective may wait (0: forever)
    sequence_parallel: bool = False    # under tp: norms and residuals split along the sequence

    def layout(self, world_size: int, default_schedule: str = "gpipe") -> ParallelConfig:
        """The layout on ``world_size`` ranks, absent factors inferred (not yet checked)."""
        return ParallelConfig.infer(world_size, dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp,
                                    ep=self.ep, micro_batches=self.micro_batches,
                                    schedule=self.schedule or default_schedule,
                                    stage_layers=self.stage_layers)


@dataclass(frozen=True)
class DataSection:
    prompts: str = "random"
    random_count: int = 8
    random_lengths: tuple[int, ...] = (4, 16)
    random_seed: int = 0
    dataset: str | None = None


@dataclass(frozen=True)
class GenerateSection:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0     # transformers': seen tokens' logits divided / multiplied
    presence_penalty: float = 0.0       # OpenAI's, over the generated tokens
    frequency_penalty: float = 0.0      # OpenAI's, times each generated token's count
    min_p: float = 0.0                  # keep candidates of at least min_p x the top one's p
    min_tokens: int = 0                 # EOS, stop ids and stop strings ignored until then
    n: int = 1                          # samples per prompt, from one prefill
    logprobs: int | None = None         # each new token's log p and its K best alternatives
    prompt_logprobs: int | None = None  # each prompt token's, the same way
    stop_at_eos: bool = True
    save_logits: bool = False
    batching: str = "continuous"    # or "static": every micro-batch runs to its longest row
    batch_size: int = 0             # rows in flight per micro-batch (0: what fits)
    cuda_graphs: bool = False       # each decode step a replayed CUDA graph (one rank a model)
    prefix_cache: bool | None = None    # rows share cached prompt prefixes (None: wherever
                                        # exact; true: refused where it cannot be)
    kv_block_size: int = 16         # positions per block of the paged KV cache
    kv_memory: float = 0.0          # its size: <= 1 a fraction of free memory, > 1 bytes
                                    # (0: half the free memory)
    stop: tuple[str, ...] = ()      # stop strings: a row ends once its text holds one
    stop_token_ids: tuple[int, ...] = ()    # ids that end a row as EOS does (reason "stop")
    wave_size: int = 0              # prompts per wave (0: all at once); the output is
                                    # saved and a stop is possible after each wave
    resume: str | None = None       # "auto": skip the prompts a stopped run finished


@dataclass(frozen=True)
class TrainSection(OptimizerSettings):
    """The optimizer's settings (optimizer, lr, schedule, betas, ...; see ``OptimizerSettings``)
    and the run's."""
    steps: int = 10
    global_batch: int = 8
    seq_len: int | None = None          # needed by .bin and .jsonl data
    long_rows: str = "refuse"           # a fine-tuning row over seq_len + 1 tokens: or "cut"
    pack: bool = False                  # samples packed several to a row, each its own document
    recompute: str = "none"
    zero: int = 0                       # split over dp: 1 optimizer state, 2 + grads, 3 + weights
    loss_scale: float = 65536.0         # float16 compute: the initial dynamic loss scale
    loss_scale_window: int = 2000       # good steps in a row before the scale doubles
    save_every: int = 0                 # 0: only at the end
    async_save: bool = False            # checkpoints written by a thread as training goes on
    serial_save: bool = False           # one file, the ranks' slices written one at a time
    resume: str | None = None           # a checkpoint path, or "auto"
    seed: int = 0
    shuffle: bool = False
    peak_tflops: float = 0.0            # per rank, for MFU; 0: measured by a GEMM probe
    bucket_mb: float = 25.0             # dp gradient bucket size in MiB (PyTorch DDP's)
    aux_loss_coef: float | None = None  # a MoE router's load-balancing loss; None: the
                                        # config's (when it sets output_router_logits)
    lora_rank: int | None = None        # LoRA: train adapters of this rank, the base frozen
    lora_alpha: float | None = None     # their scale is alpha / rank (None: the rank)
    lora_targets: tuple[str, ...] | None = None   # q,k,v,o,gate,up,down (None: q,v)
    lora_from: str | None = None        # a peft adapter folder to start from


@dataclass(frozen=True)
class ScoreSection:
    data: str | None = None             # the sequences whose log-probabilities are scored
    prefix_cache: bool | None = None    # rows that begin alike compute their beginning once
                                        # (None: wherever exact; true: refused elsewhere)


@dataclass(frozen=True)
class OutputSection:
    path: str | None = None
    trace: str | None = None            # a timeline of every rank (Chrome trace JSON)


@dataclass(frozen=True)
class Job:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    train: TrainSection = field(default_factory=TrainSection)
    score: ScoreSection = field(default_factory=ScoreSection)
    output: OutputSection = field(default_factory=OutputSection)


SECTIONS = [f.name for f in fields(Job)]
_SECTION_TYPES = get_type_hints(Job)
_INPUT_KEYS = {("model", "checkpoint"), ("data", "prompts"), ("data", "dataset"),
               ("score", "data")}


def read_job_file(path: str | Path) -> dict:
    """The job file as nested dicts, relative input paths made relative to the file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JobError(f"{path}: no such job file") from None
    except IsADirectoryError:
        raise JobError(f"{path}: is a folder, not a job file (.toml)") from None
    except UnicodeDecodeError as e:
        raise JobError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise JobError(f"{path}: not valid TOML ({e})") from None
    for section, key in _INPUT_KEYS:
        value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str) and _is_file_path(value) and not Path(value).is_absolute():
            raw[section][key] = str(path.parent / value)
    return raw


def _is_file_path(value: str) -> bool:
    return not value.startswith(PRESET_PREFIX) and value not in ("random", "synthetic")


def parse_set(assignment: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is read as TOML (numbers,
    booleans, lists, quoted strings), and as a plain string when it is not TOML."""
    target, sep, text = assignment.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot or not key:
        raise JobError(f"--set {assignment!r}: expected section.key=value, e.g. "
                       "--set generate.max_new_tokens=64")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return section, key, value


def merge(base: dict, section: str, key: str, value: Any) -> None:
    if not isinstance(base.get(section, {}), dict):
        raise JobError(f"[{section}] must be a table")
    base.setdefault(section, {})[key] = value


def build_job(raw: dict, source: str = "job",
              origins: dict[tuple[str, str], str] | None = None) -> Job:
    """Typed ``Job`` from nested dicts; every unknown name, wrong type and value out of its
    range (``settings.RULES``) is reported, each with where it came from: ``origins`` names
    the source of a (section, key) that did not come from ``source`` (``--set ...``, a flag)."""
    origins = origins or {}
    problems, sections = [], {}

    def report(section: str, key: str | None, text: str) -> None:
        where = origins.get((section, key)) if key else None
        if where is None and key is None:       # a bad section: blame any key's source
            where = next((o for (s, _), o in origins.items() if s == section), None)
        problems.append(f"{where or source}: {text}")

    for name, table in raw.items():
        if name not in SECTIONS:
            close = difflib.get_close_matches(name, SECTIONS, n=1)
            guess = f"did you mean [{close[0]}]? " if close else ""
            report(name, None, f"unknown section [{name}] ({guess}known: "
                               f"{', '.join(SECTIONS)})")
            continue
        if not isinstance(table, dict):
            report(name, None, f"[{name}] must be a table")
            continue
        cls = _SECTION_TYPES[name]
        hints = get_type_hints(cls)
        values = {}
        for key, value in table.items():
            if key not in hints:
                close = difflib.get_close_matches(key, hints, n=1)
                guess = f"did you mean {name}.{close[0]}? " if close else ""
                report(name, key, f"unknown key {name}.{key} ({guess}known: "
                                  f"{', '.join(hints)})")
                continue
            try:
                values[key] = _coerce(value, hints[key])
            except TypeError:
                report(name, key, f"{name}.{key} = {value!r}: expected {_describe(hints[key])}")
                continue
            out_of_range = settings.problem(f"{name}.{key}", values[key])
            if out_of_range:
                report(name, key, out_of_range)
        if not problems:
            sections[name] = cls(**values)
    if problems:
        raise JobError("; ".join(problems))
    return Job(**sections)


def _coerce(value: Any, hint) -> Any:
    """``value`` as type ``hint`` (int, float, bool, str, tuple[int, ...], or X | None)."""
    args = getattr(hint, "__args__", ())
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        args = getattr(hint, "__args__", ())
    origin = getattr(hint, "__origin__", hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return tuple(_coerce(v, args[0]) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if hint is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _describe(hint) -> str:
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    origin = getattr(hint, "__origin__", hint)
    if origin is tuple:
        return f"list of {args[0].__name__}"
    if args and getattr(hint, "__origin__", None) is None:
        return _describe(args[0])
    return getattr(hint, "__name__", str(hint))


def load_job(path: str | Path | None, sets: list[str] = (),
             flags: dict[tuple[str, str], Any] | None = None,
             flag_names: dict[tuple[str, str], str] | None = None) -> Job:
    """The job from a file (or the defaults), ``--set`` assignments, then explicit flags.
    ``flag_names`` gives each flag's spelling (``--lr``) for the messages."""
    raw = read_job_file(path) if path is not None else {}
    origins: dict[tuple[str, str], str] = {}
    for assignment in sets:
        section, key, value = parse_set(assignment)
        merge(raw, section, key, value)
        origins[(section, key)] = f"--set {assignment}"
    for (section, key), value in (flags or {}).items():
        if value is not None:
            merge(raw, section, key, value)
            origins[(section, key)] = (flag_names or {}).get((section, key),
                                                             f"the {section}.{key} flag")
    return build_job(raw, str(path) if path is not None else "job", origins)


def check_same_job(comm, job: Job) -> None:
    """Every rank holds rank 0's job: ranks started with other flags (an MPMD launch) or
    reading files that differ between nodes would run different work and wait on each
    other until the timeout. Rank 0's settings go to every rank as bytes; a rank whose
    own differ raises naming the first that does (collective; ``everyone`` reports it)."""
    if comm.Get_size() == 1:
        return
    import json

    import numpy as np
    mine = {f"{s.name}.{k.name}": repr(getattr(getattr(job, s.name), k.name))
            for s in fields(job) for k in fields(getattr(job, s.name))}
    text = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
    size = np.array([text.size], dtype=np.int64)
    comm.Bcast(size, root=0)
    theirs = text.copy() if comm.Get_rank() == 0 else np.empty(int(size[0]), dtype=np.uint8)
    comm.Bcast(theirs, root=0)
    rank0 = json.loads(theirs.tobytes().decode())
    for key in sorted(set(mine) | set(rank0)):
        if mine.get(key) != rank0.get(key):
            raise HpcparError(f"rank {comm.Get_rank()} was started with another job than rank "
                              f"0's: {key} is {mine.get(key)} there, {rank0.get(key)} on rank "
                              f"0; start every rank with the same command and files")
