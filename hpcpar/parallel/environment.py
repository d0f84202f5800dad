"""Checked numbers and environment variables, for every layer: one rule per value, one
sentence per problem.

    problem("train.lr", -1, NON_NEGATIVE)   -> "train.lr must be >= 0, got -1"
    environment_value("HPCPAR_OPS")          -> "auto" (its default) or the checked value

Every number must be finite (NaN and infinity pass no comparison a user means). A rule is pure
data: a ``Range`` (a number), ``Choice``, ``Count``, ``Text``, ``Pipe`` or ``Spec``.

``ENVIRONMENT`` lists every ``HPCPAR_*`` variable hpcpar reads, each with its rule and default.
The core declares its own here (the array backend, CUDA-aware MPI, the ops); the layers above
add theirs with ``declare`` where they read them (the models' chat templates, the jobs'
settings). Code reads one only through ``environment_value`` (or ``environment_number``), and
``check_environment`` reads every one that is set when a job starts, so a bad value, or an
``HPCPAR_`` name that is none of them, is one line naming the variable, the value and what it
accepts (status 2) before any work.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Callable

from .errors import HpcparError

SEED_LIMIT = 2 ** 63
INT64_LIMIT = 2 ** 63          # no setting is a number past a 64-bit integer


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

    def accepts(self, world_size: int | None = None) -> str:
        """What an environment variable of this range accepts (the table's rules share
        ``accepts`` and ``parse``)."""
        return "a number " + self.describe()

    def parse(self, text: str, world_size: int | None = None) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("") from None
        if not math.isfinite(value) or not self.contains(value):
            raise ValueError("")
        return value


@dataclass(frozen=True)
class Choice:
    """One of ``values``, in any case; ``aliases`` are other spellings of one of them."""

    values: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def accepts(self, world_size: int | None = None) -> str:
        return "one of " + ", ".join(self.values) + (f" ({self.note})" if self.note else "")

    def parse(self, text: str, world_size: int | None = None) -> str:
        word = text.lower()
        word = dict(self.aliases).get(word, word)
        if word not in self.values:
            raise ValueError("")
        return word


@dataclass(frozen=True)
class Count:
    """A whole number >= ``low``; with ``at_most_world``, at most the job's ranks."""

    low: int = 1
    at_most_world: bool = False
    note: str = ""

    def accepts(self, world_size: int | None = None) -> str:
        high = (f" and <= {world_size}, the job's ranks" if self.at_most_world and world_size
                else "")
        return f"an integer >= {self.low}{high}" + (f" ({self.note})" if self.note else "")

    def parse(self, text: str, world_size: int | None = None) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("") from None
        if value < self.low:
            raise ValueError("")
        if self.at_most_world and world_size is not None and value > world_size:
            raise ValueError(f"more than the job's {world_size} ranks")
        return value


@dataclass(frozen=True)
class Text:
    """Any text that is not empty (a folder, a command); ``what`` says which."""

    what: str

    def accepts(self, world_size: int | None = None) -> str:
        return self.what

    def parse(self, text: str, world_size: int | None = None) -> str:
        return text


@dataclass(frozen=True)
class Pipe:
    """The descriptor of an open pipe this process inherited (hpcpar sets it for a child)."""

    what: str

    def accepts(self, world_size: int | None = None) -> str:
        return f"the descriptor of an open pipe ({self.what})"

    def parse(self, text: str, world_size: int | None = None) -> int:
        try:
            fd = int(text)
            is_pipe = fd >= 0 and stat.S_ISFIFO(os.fstat(fd).st_mode)
        except (ValueError, OSError):
            is_pipe = False
        if not is_pipe:
            raise ValueError("")
        return fd


@dataclass(frozen=True)
class Spec:
    """A structured text: ``read(text, world_size)`` returns its value or raises ValueError
    saying what is wrong; ``form`` is what it accepts."""

    form: str
    read: Callable[[str, int | None], Any]

    def accepts(self, world_size: int | None = None) -> str:
        return self.form

    def parse(self, text: str, world_size: int | None = None) -> Any:
        return self.read(text, world_size)


def _number(x: float) -> str:
    if x == SEED_LIMIT:
        return "2^63"
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(1)
NON_NEGATIVE = Range(0)
SEED = Range(0, SEED_LIMIT, high_open=True)
FRACTION = Range(0, 1, high_open=True)

YES_NO = (("yes", "1"), ("true", "1"), ("on", "1"), ("no", "0"), ("false", "0"), ("off", "0"))

# every HPCPAR_* variable -> (rule, default); the core's, and what ``declare`` adds
ENVIRONMENT: dict[str, tuple[Any, Any]] = {
    "HPCPAR_BACKEND": (Choice(("auto", "numpy", "cupy", "strict"), note=(
        "the arrays of a job whose backend is auto; strict: the tests' pretend device")), "auto"),
    "HPCPAR_CUDA_AWARE": (Choice(("auto", "1", "0"), YES_NO, note=(
        "1: MPI gets device buffers, 0: staged through host memory, auto: as the MPI library "
        "says")), "auto"),
    "HPCPAR_OPS": (Choice(("auto", "native", "device"), note=(
        "native: the NumPy reference ops on a GPU too, for checks; device: the GPU's table "
        "on the strict backend, each kernel counted as one operation")), "auto"),
    "HPCPAR_NCCL_OVERLAP": (Choice(("0", "1"), YES_NO, note=(
        "1: NCCL's non-blocking gathers (ZeRO-3's) on a stream of their own, beside the "
        "compute; it has not run on two GPUs yet")), "0"),
}


def declare(variables: dict[str, tuple[Any, Any]]) -> None:
    """Add a layer's variables (name -> (rule, default)) to ``ENVIRONMENT``."""
    ENVIRONMENT.update(variables)


def problem(name: str, value: Any, rule: Range | None) -> str | None:
    """Why ``value`` is not a valid ``name`` , or None. A list is checked
    element by element."""
    if rule is None or value is None:
        return None
    for item in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue                                   # the type check reports it
        shown = list(value) if isinstance(value, (list, tuple)) else value
        if (isinstance(item, float) and not math.isfinite(item)) or not rule.contains(item):
            return f"{name} must be {rule.describe()}, got {shown}"
        if isinstance(item, int) and abs(item) >= INT64_LIMIT:     # nothing holds it
            return f"{name} must be {rule.describe()} and below 2^63, got {shown}"
    return None


def problems(section: str, values: dict[str, Any], rules: dict[str, Range]) -> list[str]:
    """Every out-of-range value of ``values`` whose key has a rule in ``rules``, named
    ``section.key``."""
    return [p for key, value in values.items()
            if (p := problem(f"{section}.{key}", value, rules.get(key))) is not None]


def environment_value(name: str, world_size: int | None = None) -> Any:
    """The environment variable ``name`` (a key of ``ENVIRONMENT``) checked against its rule,
    or its default when unset or empty. ``world_size`` bounds the ones that name ranks."""
    default = ENVIRONMENT[name][1]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    return parse_environment(name, text, world_size)


def parse_environment(name: str, text: str, world_size: int | None = None) -> Any:
    """``text`` as the value of ``name``; a bad one is an error naming the variable, the value
    and what the variable accepts."""
    rule = ENVIRONMENT[name][0]
    try:
        return rule.parse(text, world_size)
    except ValueError as e:
        why = f"{e}; " if str(e) else ""
        raise HpcparError(f"{name}={text!r}: {why}must be {rule.accepts(world_size)}; fix or "
                          "unset it") from None


def environment_number(name: str) -> float:
    """The environment variable ``name`` (a number of ``ENVIRONMENT``) as a checked number, or
    its default when unset or empty."""
    return float(environment_value(name))


def check_environment(world_size: int | None = None) -> None:
    """Read every ``HPCPAR_*`` variable that is set now, so a bad value, or a name hpcpar does
    not read (a typo), is reported before any work: one error listing each."""
    problems = []
    for name in sorted(os.environ):
        if not name.startswith("HPCPAR_"):
            continue
        if name not in ENVIRONMENT:
            close = difflib.get_close_matches(name, ENVIRONMENT, n=1)
            hint = (f"did you mean {close[0]}?" if close
                    else "it reads " + ", ".join(ENVIRONMENT))
            problems.append(f"{name} is not a variable hpcpar reads ({hint}); unset it")
            continue
        try:
            environment_value(name, world_size)
        except HpcparError as e:
            problems.append(str(e))
    if problems:
        raise HpcparError("; ".join(problems))
