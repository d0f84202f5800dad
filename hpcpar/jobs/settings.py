"""The jobs' settings: the allowed range of every numeric setting of a job, and the
``HPCPAR_*`` variables the jobs and their batch scripts read, written once.

A setting reaches a job from a job file, ``--set``, a flag, a prompt line or an environment
variable; whichever it came from, it is checked here, before any work, against one rule:

    RULES["train.lr"]                    a finite number >= 0
    ENVIRONMENT["HPCPAR_SAVE_SECONDS"]   a finite number >= 0 (0: at every step)

The rule types, the variable table and its reading are the core's (``parallel.environment``);
this module declares the jobs' variables and imports the modules that declare the others
(``models.render_limits``, ``faults``), so its table holds every one.
"""

from __future__ import annotations

from typing import Any

from ..models import render_limits  # noqa: F401  (declares the chat templates' variables)
from ..parallel.environment import (ENVIRONMENT, POSITIVE, SEED, SEED_LIMIT, YES_NO, Choice,
                                    Count, Pipe, Range, Text, check_environment, declare,
                                    environment_number, environment_value, parse_environment)
from ..parallel.environment import problem as _problem
from ..parallel.optim.settings import OPTIMIZER_RULES
from . import faults  # noqa: F401  (declares HPCPAR_FAULT)

__all__ = ["ENVIRONMENT", "RULES", "SEED_LIMIT", "check_environment", "environment_number",
           "environment_value", "parse_environment", "problem", "problems"]

# "section.key" of a job (the flags and --set use the same names) -> its range
RULES: dict[str, Range] = {
    "parallel.dp": POSITIVE, "parallel.pp": POSITIVE, "parallel.tp": POSITIVE,
    "parallel.cp": POSITIVE, "parallel.ep": POSITIVE,
    "parallel.micro_batches": POSITIVE, "parallel.virtual_stages": POSITIVE,
    "parallel.stage_layers": POSITIVE,
    "parallel.timeout": Range(0, note="seconds; 0 waits forever"),
    "data.random_count": POSITIVE, "data.random_lengths": POSITIVE, "data.random_seed": SEED,
    "generate.max_new_tokens": POSITIVE,
    "generate.temperature": Range(0, note="0 is greedy"),
    "generate.top_k": Range(0, note="0 turns it off"),
    "generate.top_p": Range(0, 1, low_open=True),
    "generate.seed": SEED,
    "generate.repetition_penalty": Range(0, low_open=True, note="1: none; transformers'"),
    "generate.presence_penalty": Range(-2, 2, note="0: none; OpenAI's"),
    "generate.frequency_penalty": Range(-2, 2, note="0: none; OpenAI's"),
    "generate.min_p": Range(0, 1, note="0 turns it off"),
    "generate.min_tokens": Range(0, note="0: none"),
    "generate.stop_token_ids": Range(0, note="token ids"),
    "generate.n": Range(1, 1024, note="samples per prompt"),
    "generate.logprobs": Range(0, 20, note="alternatives per token; 0: the token's own"),
    "generate.prompt_logprobs": Range(0, 20, note="alternatives per token; 0: the token's own"),
    "generate.batch_size": Range(0, note="0: what fits the KV cache"),
    "generate.kv_block_size": Range(1, 1024, note="a power of two"),
    "generate.kv_memory": Range(0, note="<= 1: a fraction of the free memory, > 1: bytes"),
    "generate.wave_size": Range(0, note="0: all prompts in one wave"),
    "train.steps": POSITIVE, "train.global_batch": POSITIVE,
    "train.seq_len": Range(2, note="a sample needs an input and a next token"),
    "train.zero": Range(0, 3, note="0 off; split over dp: 1 the optimizer state, 2 and the "
                        "gradients, 3 and the weights"),
    "train.loss_scale": Range(0, low_open=True), "train.loss_scale_window": POSITIVE,
    "train.save_every": Range(
        0, note="0: only at the end"),
    "train.seed": SEED, "train.peak_tflops": Range(0, note="0: measured by a GEMM probe"),
    "train.bucket_mb": Range(0, low_open=True),
    "train.aux_loss_coef": Range(0, note="0 turns the router's load-balancing loss off"),
    **{f"train.{key}": rule for key, rule in OPTIMIZER_RULES.items()},
}


declare({
    "HPCPAR_SAVE_SECONDS": (Range(0, note="seconds; 0 saves at every step"), 1.0),
    "HPCPAR_PROGRESS_SECONDS": (Range(0, note="seconds; 0: no progress lines"), 30.0),
    "HPCPAR_COMM": (Choice(("auto", "mpi", "nccl"), note=(
        "the batch scripts' --comm")), "auto"),
    "HPCPAR_CACHE": (Text("a folder, for the preset checkpoints (default ~/.cache/hpcpar)"),
                     None),
    "HPCPAR_LAUNCH": (Text("the command the batch scripts start the ranks with"), None),
    "HPCPAR_SUPERVISE": (Choice(("1", "0"), YES_NO, note="0 turns the rank keeper off"), "1"),
    "HPCPAR_SUPERVISED_FD": (Pipe("set by hpcpar's rank keeper for the rank it runs; never "
                                  "set it yourself"), None),
    "HPCPAR_PAGED_DEVICE": (Choice(("0", "1"), YES_NO, note=(
        "1: continuous batching's paged KV cache on a device backend too (a GPU, or the "
        "strict backend); it has not run on a GPU yet")), "0"),
    "HPCPAR_FAKE_NODES": (Count(1, at_most_world=True, note=(
        "tests: K blocks of consecutive ranks that play K nodes")), None),
})


def problem(name: str, value: Any, rule: Range | None = None) -> str | None:
    """Why ``value`` is not a valid ``name`` (a key of ``RULES``, unless ``rule`` is given),
    or None. A list is checked element by element."""
    return _problem(name, value, rule or RULES.get(name))


def problems(section: str, values: dict[str, Any]) -> list[str]:
    """Every out-of-range value of a job section (or of any object's fields named as it)."""
    return [p for key, value in values.items()
            if (p := problem(f"{section}.{key}", value)) is not None]
