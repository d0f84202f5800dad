"""A LoRA run (``--lora-rank``, ``--lora-alpha``, ``--lora-targets``, ``--lora-from``): its
settings checked before any work, where its adapters start, and what its checkpoints say.

The base model is frozen (read in the compute dtype; no gradient, no optimizer state, no
float32 copy); the adapters (``models.lora``) are the run's only parameters, float32
master weights with their own optimizer state, split, reduced, clipped, sharded by ZeRO and
checkpointed as any parameter. A run's checkpoint holds the adapters and their state (not
the base, which it names: ``lora_base``), and the LoRA settings in its ``train``
attributes; ``export --lora`` writes it as a peft folder, ``export --merge-lora`` the base
with the adapters merged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...checkpoint.peft import check_adapter, read_adapter
from ...models.config import ModelConfig
from ...models.lora import (DEFAULT_TARGETS, AdapterSpec, LoraSettings, adapter_specs,
                            initial_adapter, target_problems)
from ...models.sharding import piece_of
from ...parallel.errors import HpcparError


@dataclass(frozen=True)
class LoraRun:
    settings: LoraSettings
    seed: int
    initial: dict | None = None       # --lora-from's tensors (whole), by hpcpar's names
    source: str | None = None         # --lora-from's folder

    def attrs(self, base: str) -> dict:
        """The ``train`` attributes of its checkpoints."""
        s = self.settings
        return {"lora_rank": s.rank, "lora_alpha": s.alpha,
                "lora_targets": json.dumps(list(s.targets)),
                "lora_base": str(Path(base).resolve())}

    def specs(self, cfg: ModelConfig, layers=None, experts=None) -> list[AdapterSpec]:
        """The adapters of ``layers`` (default: every layer), of the experts ``experts`` only
        (default: every one)."""
        return adapter_specs(cfg, range(cfg.num_hidden_layers) if layers is None else layers,
                             self.settings, experts)


def settings_of(attrs: dict) -> LoraSettings | None:
    """The LoRA settings a training checkpoint's ``train`` attributes hold (None: a full
    fine-tuning's)."""
    if "lora_rank" not in attrs:
        return None
    return LoraSettings(int(attrs["lora_rank"]), float(attrs["lora_alpha"]),
                        tuple(json.loads(attrs["lora_targets"])))


def lora_run(tr, cfg: ModelConfig, resume_attrs: dict | None) -> LoraRun | None:
    """The run's LoRA from the [train] settings ``tr`` (None: full fine-tuning), checked:
    one error naming the setting."""
    resumed = settings_of(resume_attrs) if resume_attrs else None
    if tr.lora_rank is None and not tr.lora_from:
        given = [f for f, v in (("--lora-alpha", tr.lora_alpha),
                                ("--lora-targets", tr.lora_targets)) if v is not None]
        if given:
            raise HpcparError(f"{' and '.join(given)} without --lora-rank: give --lora-rank R "
                              "(or --lora-from a peft folder) to train a LoRA adapter")
        if resumed is not None:
            raise HpcparError("the checkpoint resumed is a LoRA run's; give its --lora-rank, "
                              "--lora-alpha and --lora-targets again to resume it")
        return None
    initial = None
    if tr.lora_from:
        settings, initial = read_adapter(Path(tr.lora_from), cfg)
        given = {"--lora-rank": (tr.lora_rank, settings.rank),
                 "--lora-alpha": (tr.lora_alpha, settings.alpha),
                 "--lora-targets": (None if tr.lora_targets is None else tuple(tr.lora_targets),
                                    settings.targets)}
        differ = [f"{flag} {mine} (the folder's: {theirs})" for flag, (mine, theirs)
                  in given.items() if mine is not None and
                  (sorted(mine) != sorted(theirs) if flag == "--lora-targets"
                   else mine != theirs)]
        if differ:
            raise HpcparError(f"--lora-from {tr.lora_from} sets the rank, alpha and targets; "
                              f"{'; '.join(differ)}: leave those flags out")
    else:
        rank = tr.lora_rank
        alpha = float(rank if tr.lora_alpha is None else tr.lora_alpha)
        targets = tuple(dict.fromkeys(DEFAULT_TARGETS if tr.lora_targets is None
                                      else tr.lora_targets))
        settings = LoraSettings(rank, alpha, targets)
    problems = target_problems(cfg, settings.targets, settings.rank)
    if tr.lora_alpha is not None and not tr.lora_alpha > 0:
        problems.append(f"--lora-alpha {tr.lora_alpha:g}: give a positive number (the "
                        "adapter is scaled by alpha / rank)")
    if problems:
        raise HpcparError("; ".join(problems))
    run = LoraRun(settings, tr.seed, initial, tr.lora_from)
    if initial is not None:
        _check_tensors(run, cfg, initial)
    if resume_attrs is not None and resumed != settings:
        start = (" (to train adapters on a full run's weights, give its checkpoint as "
                 "--checkpoint and a new --out)" if resumed is None else "")
        raise HpcparError(f"the checkpoint resumed trained {_describe(resumed)}; this job "
                          f"asks for {_describe(settings)}: keep the LoRA settings to resume"
                          + start)
    return run


def _describe(s: LoraSettings | None) -> str:
    if s is None:
        return "every parameter (no LoRA)"
    return f"LoRA rank {s.rank}, alpha {s.alpha:g}, targets {','.join(s.targets)}"


def _check_tensors(run: LoraRun, cfg: ModelConfig, tensors: dict) -> None:
    """--lora-from's tensors are exactly the adapters of the model, each of its shape."""
    check_adapter(cfg, run.settings, tensors, f"--lora-from {run.source}")


def adapter_pieces(run: LoraRun, specs: list[AdapterSpec], cfg: ModelConfig, tp_rank: int,
                   tp_size: int, backend) -> dict:
    """This rank's piece of each adapter as it starts a new run (float32, on the device):
    --lora-from's, or peft's initialisation (``models.lora.initial_adapter``)."""
    out = {}
    for spec in specs:
        full = (run.initial[spec.name] if run.initial is not None
                else initial_adapter(spec, run.seed))
        piece = piece_of(spec, cfg, tp_rank, tp_size)
        local = np.zeros(piece.shape, np.float32)
        local[piece.dest] = full[piece.source]
        out[spec.name] = backend.asarray(local)
    return out


def adapter_bytes(cfg: ModelConfig, run: LoraRun, states: int) -> int:
    """A checkpoint's bytes: the float32 adapters and ``states`` optimizer states each."""
    return sum(int(np.prod(s.shape)) for s in run.specs(cfg)) * 4 * (1 + states)


class AdapterSource:
    """What a LoRA run's checkpoints are written from: the base checkpoint (its config,
    tokenizer files, ...), with ``trained``, the adapters' specs, as the tensors stored
    and given optimizer state (``train.checkpoint``)."""

    def __init__(self, ckpt, trained: list[AdapterSpec]):
        self._ckpt, self.trained = ckpt, trained

    def __getattr__(self, name):
        return getattr(self._ckpt, name)


def open_resume(path: Path, model) -> tuple | None:
    """A LoRA run's checkpoint to resume from (``train.checkpoint.open_resume`` for one that
    holds the adapters only): it and its ``train`` attributes; None when it is not one."""
    from ...checkpoint import CheckpointError
    from ...checkpoint.peft import open_run_checkpoint
    ckpt = open_run_checkpoint(path)
    if ckpt is None:
        return None
    with ckpt.open() as f:
        attrs = {k: (v.item() if isinstance(v, np.generic) else v)
                 for k, v in f["train"].attrs.items()}
    if ckpt.config != model.config:
        raise CheckpointError(f"{path}: its model differs from --checkpoint {model.path}; "
                              "resume a LoRA run with the base it was trained on")
    return ckpt, attrs
