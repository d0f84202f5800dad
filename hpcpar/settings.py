"""The allowed range of every numeric setting, written once.

A setting reaches a job from a job file, ``--set``, a flag, a prompt line or an environment
variable; whichever it came from, it is checked here, before any work, against one rule:

    RULES["train.lr"]         a finite number >= 0
    ENVIRONMENT["HPCPAR_SAVE_SECONDS"]   a finite number >= 0 (0: at every step)

Every number must be finite (NaN and infinity pass no comparison a user means). The rules are
pure data; ``problem`` turns one into the sentence a user reads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from .errors import HpcparError

SEED_LIMIT = 2 ** 63


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``<`` where the bound is open); ``note`` says what the edge
    value means ("0 turns it off")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open
                                      else value > self.high):
            return False
        return True

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        else:
            text = "any finite number"
        return text + (f" ({self.note})" if self.note else "")


def _number(x: float) -> str:
    if x == SEED_LIMIT:
        return "2^63"
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(1)
NON_NEGATIVE = Range(0)
SEED = Range(0, SEED_LIMIT, high_open=True)
FRACTION = Range(0, 1, high_open=True)

# "section.key" of a job (the flags and --set use the same names) -> its range
RULES: dict[str, Range] = {
    "parallel.dp": POSITIVE, "parallel.pp": POSITIVE, "parallel.tp": POSITIVE,
    "parallel.cp": POSITIVE,
    "parallel.micro_batches": POSITIVE, "parallel.virtual_stages": POSITIVE,
    "parallel.stage_layers": POSITIVE,
    "parallel.timeout": Range(0, note="seconds; 0 waits forever"),
    "data.random_count": POSITIVE, "data.random_lengths": POSITIVE, "data.random_seed": SEED,
    "generate.max_new_tokens": POSITIVE,
    "generate.temperature": Range(0, note="0 is greedy"),
    "generate.top_k": Range(0, note="0 turns it off"),
    "generate.top_p": Range(0, 1, low_open=True),
    "generate.seed": SEED,
    "generate.batch_size": Range(0, note="0: what fits the KV cache"),
    "generate.wave_size": Range(0, note="0: all prompts in one wave"),
    "train.steps": POSITIVE, "train.global_batch": POSITIVE,
    "train.seq_len": Range(2, note="a sample needs an input and a next token"),
    "train.lr": NON_NEGATIVE, "train.min_lr": NON_NEGATIVE,
    "train.warmup_steps": NON_NEGATIVE, "train.weight_decay": NON_NEGATIVE,
    "train.momentum": FRACTION, "train.betas": FRACTION,
    "train.eps": Range(0, low_open=True), "train.clip_grad": Range(0, note="0 turns it off"),
    "train.zero": Range(0, 1, note="0 off, 1 optimizer state split over dp"),
    "train.loss_scale": Range(0, low_open=True), "train.loss_scale_window": POSITIVE,
    "train.save_every": Range(
        0, note="0: only at the end"),
    "train.seed": SEED, "train.peak_tflops": Range(0, note="0: measured by a GEMM probe"),
    "train.bucket_mb": Range(0, low_open=True),
}

# environment variables the jobs read -> (range, default)
ENVIRONMENT: dict[str, tuple[Range, float]] = {
    "HPCPAR_SAVE_SECONDS": (Range(0, note="seconds; 0 saves at every step"), 1.0),
    "HPCPAR_PROGRESS_SECONDS": (Range(0, note="seconds; 0: no progress lines"), 30.0),
}


def problem(name: str, value: Any, rule: Range | None = None) -> str | None:
    """Why ``value`` is not a valid ``name`` (a key of ``RULES``), or None. A list is checked
    element by element."""
    rule = rule or RULES.get(name)
    if rule is None or value is None:
        return None
    for item in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue                                   # the type check reports it
        if not math.isfinite(item) or not rule.contains(item):
            shown = list(value) if isinstance(value, (list, tuple)) else value
            return f"{name} must be {rule.describe()}, got {shown}"
    return None


def problems(section: str, values: dict[str, Any]) -> list[str]:
    """Every out-of-range value of a job section (or of any object's fields named as it)."""
    return [p for key, value in values.items()
            if (p := problem(f"{section}.{key}", value)) is not None]


def environment_number(name: str) -> float:
    """The environment variable ``name`` (a key of ``ENVIRONMENT``) as a checked number, or
    its default when unset or empty."""
    rule, default = ENVIRONMENT[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not rule.contains(value):
        raise HpcparError(f"{name}={text!r}: must be a number {rule.describe()}; fix or unset "
                          "it")
    return value


def check_environment() -> None:
    """Read every variable of ``ENVIRONMENT`` now, so a bad one is reported before any work."""
    for name in ENVIRONMENT:
        environment_number(name)
