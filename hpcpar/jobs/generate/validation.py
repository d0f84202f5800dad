"""A generation job as every rank checks it before any work (``CheckedGeneration``): the
layout, the settings, the prompts (a file's, random, or given) with each one's limit,
sampling and stop strings, and the fingerprint a resumed run must share."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

from ...checkpoint import Checkpoint
from ...checkpoint.files import check_output
from ...models.chat import ChatTemplate
from ...models.tokenizer import StoredTokenizer
from ...parallel.device.dtypes import dtype_name, float_dtype
from ...parallel.errors import HpcparError
from ..inputs.prompts import Prompts, check_prompts, load_prompts, random_prompts
from ..inputs.sampling_settings import PromptSampling, SamplingParams
from ..inputs.stage import eos_ids, load_tokenizer, sequence_parallel_problem
from ..job import Job
from ..layout import ParallelConfig
from .decode import check_graphed_layout
from .paged_rows import check_prefix_cache
from .program import GenerationSettings
from .batch_api import is_batch_file, load_requests, screen
from .results import Logprobs, ResultShape, RowResults, Samples
from .stopping import StopStrings, decode_rows, finish_reasons


@dataclass
class CheckedGeneration:
    """A generation job as ``validate`` checked it on every rank: what its run works from."""
    layout: ParallelConfig
    dtype: np.dtype
    settings: GenerationSettings
    prompts: Prompts                   # each row's prompt: a prompt once per sample (``samples``)
    tokenizer: object
    limits: np.ndarray                 # each row's max_new_tokens
    sampling: PromptSampling           # each row's sampling settings
    eos: tuple[int, ...]               # every id that ends a row
    stops: StopStrings | None          # each prompt's stop strings (None: no prompt has any)
    stop_ids: list[np.ndarray] | None = None   # each prompt's stop_token_ids (None: none)
    samples: Samples | None = None     # the rows' prompts (None: one row per prompt)

    @property
    def results(self) -> ResultShape:
        """What the rows keep: their tokens, and the log-probabilities the prompts ask."""
        s, prompt_k = self.sampling, int(self.sampling.prompt_logprobs.max(initial=-1))
        return ResultShape(self.settings.max_new_tokens, int(s.logprobs.max(initial=-1)),
                           prompt_k, max(self.prompts.lengths) if prompt_k >= 0 else 0)


def validate(job: Job, ckpt: Checkpoint, world_size: int,
             prompts: Prompts | None) -> CheckedGeneration:
    """The generation job checked against the checkpoint, the world and its prompts (read
    here unless given), every rank alike: what is wrong in one line, before any work."""
    cfg, gen = ckpt.config, job.generate
    layout = job.parallel.layout(world_size)
    layout.check(cfg, world_size)
    settings = _settings(job, cfg, layout)
    sampling = settings.sampling
    tokenizer = load_tokenizer(ckpt)
    source = job.data.prompts if prompts is None else "the prompts given to run_generation"
    from_file = prompts is None and source != "random"
    if prompts is None:
        prompts = _job_prompts(job, ckpt, tokenizer)
    if prompts.requests is not None:           # a Batch API file: refused requests get errors
        _check_batch_output(job.output.path, source, tokenizer)
        prompts = screen(prompts, lambda one, where: _check_each(one, cfg, settings, layout,
                                                                 gen, where))
    _check_each(prompts, cfg, settings, layout, gen, source)
    if job.output.path:
        inputs = {"checkpoint": ckpt.path, "prompts": source if from_file else None}
        check_output(job.output.path, inputs, kind="generation")
        if settings.save_logits and Path(job.output.path).suffix.lower() == ".jsonl":
            raise HpcparError(f"--save-logits stores the prompt logits in HDF5, and "
                              f"{job.output.path} is JSON lines; write an .h5 output for them")
    per_prompt = prompts.sampling_for(sampling)
    stops = StopStrings.of(gen.stop, prompts.stops, len(prompts), tokenizer,
                           per_prompt.min_tokens)
    if stops is not None and tokenizer is None:
        raise HpcparError("stop strings are matched in the decoded text, and this checkpoint "
                          "has no tokenizer; convert the model from a folder that holds "
                          "tokenizer.json, or drop the stop strings")
    if any(s == "" for s in gen.stop):
        raise HpcparError("generate.stop holds an empty string, which every text contains; "
                          "give non-empty stop strings")
    if (per_prompt.temperature == 0).all() and (gen.top_k or gen.top_p != 1.0 or gen.min_p):
        raise HpcparError("top_k / top_p / min_p cut the candidates of sampling, and every "
                          "prompt is greedy (temperature 0), so they would do nothing: set "
                          "--temperature above 0, or drop them")
    limits = prompts.limits(settings.max_new_tokens)
    stop_ids = _stop_ids(gen.stop_token_ids, prompts, cfg.vocab_size)
    counts = prompts.samples_for(gen.n)
    width = int(counts.max())
    if width > 1:                       # one row per sample: row p * width + s
        prompts, limits = prompts.repeated(width), np.repeat(limits, width)
        per_prompt = per_prompt.samples(counts, width)
        stops = StopStrings.of(gen.stop, prompts.stops, len(prompts), tokenizer,
                               per_prompt.min_tokens)
        stop_ids = None if stop_ids is None else [i for i in stop_ids for _ in range(width)]
    checked = CheckedGeneration(layout, float_dtype(job.model.dtype), settings, prompts,
                                tokenizer, limits, per_prompt, eos_ids(ckpt), stops, stop_ids,
                                Samples(counts, width))
    check_prefix_cache(settings, checked.results, layout.cp)
    return checked


def _settings(job: Job, cfg, layout: ParallelConfig) -> GenerationSettings:
    """The generation settings, checked against the layout and the model (no prompts)."""
    if layout.schedule != "gpipe":
        raise HpcparError(f"schedule {layout.schedule!r} is a training schedule; generation "
                          "runs the 'gpipe' forward schedule")
    split_problem = sequence_parallel_problem(job, layout, cfg)
    if split_problem:
        raise HpcparError(split_problem)
    gen = job.generate
    if layout.cp > 1 and gen.save_logits:
        raise HpcparError(f"cp {layout.cp} with --save-logits: the prompt logits of a prompt "
                          "split over cp are not gathered; drop one of them")
    if layout.cp > 1 and cfg.sliding_window is not None:
        raise HpcparError(f"cp {layout.cp}: a KV cache split over cp holds no window of "
                          f"positions, and this model attends a sliding window of "
                          f"{cfg.sliding_window}; generate it without --cp")
    sampling = SamplingParams(**{f.name: getattr(gen, f.name) for f in fields(SamplingParams)})
    sampling.check()
    if gen.batching not in ("continuous", "static"):
        raise HpcparError(f"generate.batching must be 'continuous' or 'static', got "
                          f"{gen.batching!r}")
    if gen.batching == "static" and gen.batch_size:
        raise HpcparError(f"generate.batch_size {gen.batch_size} applies to continuous "
                          "batching; static batching runs every prompt of a micro-batch at "
                          "once: bound it with --micro-batches or --wave-size instead, or "
                          "drop --batching static")
    if gen.kv_block_size & (gen.kv_block_size - 1):
        raise HpcparError(f"generate.kv_block_size {gen.kv_block_size} is not a power of two: "
                          "pass --kv-block-size 16 (the default), 8, 32, 64, ...")
    settings = GenerationSettings(gen.max_new_tokens, sampling, gen.stop_at_eos,
                                  gen.save_logits, gen.batching, gen.batch_size,
                                  gen.cuda_graphs, gen.prefix_cache, gen.kv_block_size,
                                  gen.kv_memory)
    if gen.cuda_graphs:
        check_graphed_layout(layout, cfg)
    return settings


def _check_each(prompts: Prompts, cfg, settings: GenerationSettings, layout: ParallelConfig,
                gen, source: str) -> None:
    """Every prompt and its own settings fit the model and the job (``PromptError`` /
    ``HpcparError`` naming the first that does not, by its index)."""
    check_prompts(prompts, cfg, settings.max_new_tokens, source)
    per_prompt = prompts.sampling_for(settings.sampling)
    for n, own in enumerate(prompts.sampling or []):
        cuts = [k for k in ("top_k", "top_p", "min_p") if k in own]
        if cuts and per_prompt.temperature[n] == 0:
            raise HpcparError(f"{source}: prompt {n} sets {' / '.join(cuts)}, which cut the "
                              "candidates of sampling, and it is greedy (temperature 0), so "
                              "they would do nothing: give it a temperature above 0, or drop "
                              "them")
    _check_logprobs(per_prompt, layout, cfg.vocab_size, source)
    limits = prompts.limits(settings.max_new_tokens)
    over = np.flatnonzero(per_prompt.min_tokens > limits)
    if len(over):
        n = int(over[0])
        raise HpcparError(f"{source}: prompt {n} asks for min_tokens "
                          f"{per_prompt.min_tokens[n]}, more than its max_new_tokens "
                          f"{limits[n]}; lower min_tokens or raise max_new_tokens")
    _stop_ids(gen.stop_token_ids, prompts, cfg.vocab_size)


def _check_batch_output(path: str | None, source: str, tokenizer) -> None:
    """A Batch API file's results are Batch API output lines, whose choices are text: a
    ``.jsonl`` output, and the model's tokenizer."""
    if tokenizer is None:
        raise HpcparError(f"{source} holds OpenAI Batch API requests, whose answers are text, "
                          f"and the checkpoint holds no tokenizer; convert the model from a "
                          f"folder with its tokenizer files, or give token-id prompts "
                          f"({{\"ids\": [...]}} lines)")
    if path and Path(path).suffix.lower() != ".jsonl":
        raise HpcparError(f"{source} holds OpenAI Batch API requests, whose results are Batch "
                          f"API output lines; write them to a .jsonl (not {path})")


def _check_logprobs(per_prompt: PromptSampling, layout: ParallelConfig, vocab: int,
                    source: str) -> None:
    """Log-probabilities a run can give: prompt log-probs need every position's states on
    one rank (not split over cp), and K alternatives need a vocabulary of K tokens."""
    if layout.cp > 1 and (per_prompt.prompt_logprobs >= 0).any():
        raise HpcparError(f"cp {layout.cp} with prompt_logprobs: the states of a prompt split "
                          "over cp are not gathered for them; drop one of them")
    for key in ("logprobs", "prompt_logprobs"):
        k = int(getattr(per_prompt, key).max(initial=-1))
        if k > vocab:
            raise HpcparError(f"{source}: {key} {k} asks for more alternatives than the "
                              f"model's {vocab} tokens; give at most {vocab}")


def _stop_ids(job_ids: tuple[int, ...], prompts: Prompts,
              vocab: int) -> list[np.ndarray] | None:
    """Each prompt's stop_token_ids: its line's own, else the job's; None when none has any.
    An id outside the vocabulary is an error (it could never end a row)."""
    own = prompts.stop_ids or [None] * len(prompts)
    per_prompt = [np.asarray(job_ids if o is None else o, np.int64) for o in own]
    for n, ids in enumerate(per_prompt):
        if len(ids) and ids.max() >= vocab:
            where = (f"prompt {n}'s stop_token_ids" if own[n] is not None
                     else "--stop-token-id / generate.stop_token_ids")
            raise HpcparError(f"{where}: {int(ids.max())} is not a token id of this model "
                              f"(its vocabulary has {vocab}); give ids below {vocab}")
    return per_prompt if any(len(ids) for ids in per_prompt) else None


def _job_prompts(job: Job, ckpt: Checkpoint, tokenizer) -> Prompts:
    """The prompts the job's ``[data]`` names: random ones, or a file's."""
    source = job.data.prompts
    if source != "random":
        chat = ChatTemplate.from_files(ckpt.tokenizer_files(), ckpt.path)
        if is_batch_file(source):
            return load_requests(source, tokenizer, chat, job.generate.temperature)
        return load_prompts(source, tokenizer, chat)
    lengths = job.data.random_lengths
    if len(lengths) != 2:
        raise HpcparError(f"data.random_lengths must be [min, max], got {list(lengths)}")
    return random_prompts(job.data.random_count, (lengths[0], lengths[1]),
                          ckpt.config.vocab_size, job.data.random_seed)


def fingerprint(job: Job, ckpt: Checkpoint, checked: CheckedGeneration) -> dict:
    """What a resumed run must share with the stopped one for the file to be one run's."""
    digest = hashlib.sha256()
    for ids in checked.prompts.ids:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes() + b"|")
    if checked.prompts.max_new_tokens:         # the prompts' own limits (the job's is below)
        digest.update(json.dumps(checked.prompts.max_new_tokens).encode())
    if checked.prompts.sampling:
        digest.update(json.dumps(checked.prompts.sampling, sort_keys=True).encode())
    if checked.prompts.stops:
        digest.update(json.dumps(checked.prompts.stops).encode())
    if checked.prompts.stop_ids:
        digest.update(json.dumps(checked.prompts.stop_ids).encode())
    if checked.prompts.samples:
        digest.update(json.dumps(checked.prompts.samples).encode())
    s = checked.settings
    return {
        "checkpoint": str(Path(ckpt.path).resolve()), "model": ckpt.hf_config,
        "prompts_sha256": digest.hexdigest(), "max_new_tokens": s.max_new_tokens,
        "n": job.generate.n,
        **vars(s.sampling), "stop_at_eos": s.stop_at_eos,
        "save_logits": s.save_logits, "wave_size": job.generate.wave_size,
        "stop": list(job.generate.stop), "stop_token_ids": list(job.generate.stop_token_ids),
        "dtype": dtype_name(checked.dtype), **_adapter(job, ckpt)}


def _adapter(job: Job, ckpt: Checkpoint) -> dict:
    """--lora's part of the fingerprint: the adapter's digest (its tensors, not its path),
    absent without one."""
    if not job.model.lora:
        return {}
    from ...checkpoint.peft import adapter_digest
    return {"lora": adapter_digest(job.model.lora, ckpt.config)}


def logprob_fields(checked: CheckedGeneration, prompt: int, results: RowResults) -> dict:
    """A finished row's log-probabilities for its JSON line, where its prompt asks for them:
    ``logprobs`` (one entry per new token) and ``prompt_logprobs`` (null for the first prompt
    token, then one per token), each ``{"token_id", "token", "logprob", "top_logprobs"}``,
    the alternatives most likely first (``token``: its text, where there is a tokenizer)."""
    out, r = {}, prompt
    token = _token_text(checked.tokenizer)
    found = results.logprobs
    if found is not None and checked.sampling.logprobs[r] >= 0:
        n = int(results.lengths[r])
        out["logprobs"] = [_entry(int(results.tokens[r, t]), found, r, t, token)
                           for t in range(n)]
    found = results.prompt_logprobs
    if found is not None and checked.sampling.prompt_logprobs[r] >= 0:
        ids = checked.prompts.ids[r]
        out["prompt_logprobs"] = [None] + [_entry(int(ids[t]), found, r, t, token)
                                           for t in range(1, len(ids))]
    return out


def _entry(token_id: int, found: Logprobs, row: int, column: int, token) -> dict:
    """One position's JSON entry."""
    top = [{"token_id": int(i), **token(int(i)), "logprob": float(v)}
           for i, v in zip(found.top_ids[row, column], found.top[row, column]) if i >= 0]
    return {"token_id": token_id, **token(token_id),
            "logprob": float(found.values[row, column]), "top_logprobs": top}


@lru_cache(maxsize=4)           # one per tokenizer, its texts kept over the rows
def _token_text(tokenizer):
    """id -> {"token": its text}, or {} without a usable tokenizer."""
    if tokenizer is None or (isinstance(tokenizer, StoredTokenizer) and not tokenizer.usable()):
        return lambda i: {}
    @cache
    def text(i: int) -> dict:
        return {"token": tokenizer.decode([i], skip_special_tokens=False)}
    return text


def describe_row(checked: CheckedGeneration, prompt: int, row: np.ndarray, length: int):
    """A finished row's text and why it ended (for the JSON lines, row by row)."""
    texts, stopped = decode_rows(checked.tokenizer, row[None], np.array([length]),
                                 checked.stops, [prompt])
    reason = finish_reasons(row[None], np.array([length]), checked.eos,
                            checked.settings.stop_at_eos, stopped,
                            None if checked.stop_ids is None else [checked.stop_ids[prompt]])[0]
    return (texts[0] if texts is not None else None), reason
