"""A generation's sampling settings, as the job's ``[generate]`` section and a ``.jsonl``
prompt line give them: the job's (``SamplingParams``), and each prompt's, by global prompt
index (``PromptSampling``: its own where its line carries them, else the job's). What they
mean, and the sampling that uses them, is ``hpcpar.jobs.generate.sampling``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from ...parallel.errors import HpcparError
from .. import settings


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0: greedy
    top_k: int = 0                # 0: no top-k cut
    top_p: float = 1.0            # 1: no nucleus cut
    seed: int = 0
    repetition_penalty: float = 1.0     # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0                  # 0: no min-p cut
    min_tokens: int = 0                 # EOS, stop ids and stop strings ignored until then
    logprobs: int | None = None         # each new token's log p and K alternatives (None: no)
    prompt_logprobs: int | None = None  # the same for each prompt token (None: no)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problems(self) -> list[str]:
        """Each setting outside its range (the rules of ``hpcpar.jobs.settings``)."""
        return settings.problems("generate", vars(self))

    def check(self) -> None:
        if self.problems():
            raise HpcparError("; ".join(self.problems()))


@dataclass(frozen=True)
class PromptSampling:
    """Each prompt's sampling settings, by global prompt index: its own (a ``.jsonl`` line's
    ``temperature`` / ``top_k`` / ``top_p`` / ``seed``), else the job's."""

    temperature: np.ndarray     # float64; 0: greedy
    top_k: np.ndarray           # int64; 0: no cut
    top_p: np.ndarray           # float64; 1: no cut
    seed: np.ndarray            # int64
    repetition_penalty: np.ndarray      # float64; 1: none
    presence_penalty: np.ndarray        # float64
    frequency_penalty: np.ndarray       # float64
    min_p: np.ndarray                   # float64; 0: no cut
    min_tokens: np.ndarray              # int64; 0: none
    logprobs: np.ndarray                # int64; -1: none
    prompt_logprobs: np.ndarray         # int64; -1: none
    # what a row's draws are keyed by, with the seed and the step: its prompt (the global
    # index of the prompt it samples; not with a seed of its own) and which sample it is
    prompt: np.ndarray                  # int64
    sample: np.ndarray                  # int64
    own_seed: np.ndarray                # bool: the prompt's line gave its own seed

    @classmethod
    def build(cls, job: SamplingParams, own: list[dict]) -> "PromptSampling":
        """``own[i]``: prompt i's settings that differ from the job's (maybe none)."""
        n = len(own)
        out = cls(**{f.name: np.full(n, _stored(getattr(job, f.name)),
                                     np.int64 if f.name in INTEGER_KEYS else np.float64)
                     for f in fields(SamplingParams)},
                  prompt=np.arange(n, dtype=np.int64), sample=np.zeros(n, np.int64),
                  own_seed=np.array(["seed" in o for o in own], dtype=bool).reshape(n))
        for i, prompt_own in enumerate(own):
            for key, value in prompt_own.items():
                getattr(out, key)[i] = _stored(value)
        return out

    def samples(self, counts: np.ndarray, width: int) -> "PromptSampling":
        """Row p * width + s for sample s of prompt p (``counts[p]`` samples; the rows past
        them keep the prompt's settings and are never run)."""
        rows = np.repeat(np.arange(len(counts)), width)
        return replace(self.take(rows), sample=np.tile(np.arange(width), len(counts)))

    def take(self, rows: np.ndarray) -> "PromptSampling":
        return PromptSampling(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    @property
    def penalized(self) -> np.ndarray:
        """Which rows have a penalty on the tokens they have seen."""
        return ((self.repetition_penalty != 1.0) | (self.presence_penalty != 0.0)
                | (self.frequency_penalty != 0.0))


INTEGER_KEYS = ("top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs")


def _stored(value):
    """A setting as ``PromptSampling`` holds it: an absent one (None) as -1."""
    return -1 if value is None else value
