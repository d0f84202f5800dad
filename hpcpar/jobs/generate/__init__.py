"""Batch generation: prompts, micro-batches, the per-stage program, sampling, output."""

from ..runtime import cache_dir, resolve_checkpoint
from .engine import GenerationResult, run_generation
from .prompts import PromptError, Prompts, load_prompts, random_prompts
from .results import Logprobs, Samples
from .sampling import SamplingParams

__all__ = ["GenerationResult", "Logprobs", "PromptError", "Prompts", "Samples",
           "SamplingParams", "cache_dir", "load_prompts", "random_prompts",
           "resolve_checkpoint", "run_generation"]
