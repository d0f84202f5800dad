"""Batch generation: prompts, micro-batches, the per-stage program, sampling, output."""

from ..inputs.prompts import PromptError, Prompts, load_prompts, random_prompts
from ..inputs.sampling_settings import SamplingParams
from ..runtime import cache_dir, resolve_checkpoint
from .engine import GenerationResult, run_generation
from .results import Logprobs, Samples

__all__ = ["GenerationResult", "Logprobs", "PromptError", "Prompts", "Samples",
           "SamplingParams", "cache_dir", "load_prompts", "random_prompts",
           "resolve_checkpoint", "run_generation"]
