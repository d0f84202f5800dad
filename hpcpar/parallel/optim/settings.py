"""What an optimizer is told: its settings, their ranges, and the learning-rate schedule. Pure
data and arithmetic (no arrays), so the jobs' settings read the ranges without loading NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..environment import FRACTION, NON_NEGATIVE, Range, problems

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")
# each number of ``OptimizerSettings`` -> its range (the jobs' [train] section uses them too)
OPTIMIZER_RULES: dict[str, Range] = {
    "lr": NON_NEGATIVE, "min_lr": NON_NEGATIVE, "warmup_steps": NON_NEGATIVE,
    "weight_decay": NON_NEGATIVE, "momentum": FRACTION, "betas": FRACTION,
    "eps": Range(0, low_open=True), "clip_grad": Range(0, note="0 turns it off"),
}


@dataclass(frozen=True)
class OptimizerSettings:
    optimizer: str = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 0.0
    fused: bool = False          # on a GPU, one kernel a step (``ops.optimizer_update``)

    @classmethod
    def of(cls, section) -> "OptimizerSettings":
        """Just the optimizer's settings of a job's ``[train]`` section (a subclass)."""
        values = {f.name: getattr(section, f.name) for f in fields(cls)}
        return cls(**values | {"betas": tuple(values["betas"])})

    def problems(self) -> list[str]:
        out = []
        if self.optimizer not in OPTIMIZERS:
            out.append(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            out.append(f"lr_schedule {self.lr_schedule!r} is not one of "
                       f"{', '.join(LR_SCHEDULES)}")
        if len(self.betas) != 2:
            out.append(f"betas must be two numbers, got {list(self.betas)}")
        if self.lr_schedule != "constant" and self.min_lr > self.lr:
            out.append(f"min_lr {self.min_lr:g} is above lr {self.lr:g}: the {self.lr_schedule} "
                       f"schedule decays from lr to min_lr; lower min_lr")
        if self.optimizer == "adamw" and self.momentum:
            out.append(f"momentum {self.momentum:g} is SGD's setting and AdamW takes none (its "
                       f"moments are betas); drop momentum or use optimizer sgd")
        return out + problems("train", {f.name: getattr(self, f.name)
                                        for f in fields(OptimizerSettings)}, OPTIMIZER_RULES)


def learning_rate(s: OptimizerSettings, step: int, total_steps: int) -> float:
    """The lr of step ``step`` (1-based): linear warmup to ``lr`` over ``warmup_steps``, then
    constant, or cosine / linear decay reaching ``min_lr`` at step ``total_steps``."""
    if step <= s.warmup_steps:
        return s.lr * step / s.warmup_steps
    if s.lr_schedule == "constant" or total_steps <= s.warmup_steps:
        return s.lr
    progress = min(1.0, (step - s.warmup_steps) / (total_steps - s.warmup_steps))
    if s.lr_schedule == "cosine":
        return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.lr - (s.lr - s.min_lr) * progress
