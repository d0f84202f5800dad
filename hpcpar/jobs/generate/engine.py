"""A generation job from start to end, on every rank of ``comm``.

    validate (agreed by every rank) -> mesh and communicators -> load this rank's slices
    -> split prompts over replicas and micro-batches -> pre-flight check of the schedule
    -> run the pipeline -> collect tokens (and logits) on rank 0 -> report -> write output
"""

from __future__ import annotations

import hashlib
import json
import resource
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from time import perf_counter

import numpy as np

from ... import __version__
from ...checkpoint import Checkpoint, open_checkpoint
from ..layout import ParallelConfig
from ...parallel.dtypes import dtype_name, float_dtype
from ...parallel.errors import HpcparError
from ..job import Job
from ..launch import (EXIT_INVALID, EXIT_PREEMPTED, JobFailed, StopRequest, everyone, phase,
                      print_error, set_timeout)
from ..faults import fault_point
from ...checkpoint.files import check_output
from ..outputs import claimed
from ..replicas import owners
from ...parallel.pipeline.executor import PipelineExecutor
from .schedule import generation
from .batching import micro_batches, replica_rows
from .output import JsonLines, PartialOutput, RunShape, unpad_into
from .stopping import StopStrings, decode_rows, finish_reasons
from .continuous import ContinuousProgram, rows_in_flight, segment_steps
from .program import GenerationProgram, GenerationSettings, any_rank
from .setup import eos_ids, load_tokenizer, open_stage, resolve_checkpoint
from .stream import FinishedRows, save_interval
from .progress import Progress
from ...models.chat import ChatTemplate
from .prompts import Prompts, check_prompts, load_prompts, random_prompts
from .report import RankFigures, RunReport
from .sampling import PromptSampling, SamplingParams

TAG_LOGITS = 13


@dataclass
class GenerationResult:
    """What rank 0 holds at the end (other ranks get None)."""

    tokens: np.ndarray                    # (batch, max_new_tokens)
    lengths: np.ndarray                   # (batch,)
    prompt_lengths: np.ndarray            # (batch,)
    prompt_logits: np.ndarray | None      # (batch, max prompt length, vocab), NaN past the end
    texts: list[str] | None
    report: RunReport
    finish_reasons: list[str]             # eos or length, by prompt


@dataclass
class _Plan:
    layout: ParallelConfig
    dtype: np.dtype
    settings: GenerationSettings
    prompts: Prompts
    tokenizer: object
    limits: np.ndarray                 # each prompt's max_new_tokens
    sampling: PromptSampling           # each prompt's sampling settings
    eos: tuple[int, ...]               # every id that ends a row
    stops: StopStrings | None          # each prompt's stop strings (None: no prompt has any)


def _validate(job: Job, ckpt: Checkpoint, world_size: int, prompts: Prompts | None) -> _Plan:
    cfg = ckpt.config
    layout = job.parallel.layout(world_size)
    layout.check(cfg, world_size)
    if layout.schedule != "gpipe":
        raise HpcparError(f"schedule {layout.schedule!r} is a training schedule; generation "
                          "runs the 'gpipe' forward schedule")
    gen = job.generate
    if layout.cp > 1 and gen.save_logits:
        raise HpcparError(f"cp {layout.cp} with --save-logits: the prompt logits of a prompt "
                          "split over cp are not gathered; drop one of them")
    if layout.cp > 1 and cfg.sliding_window is not None:
        raise HpcparError(f"cp {layout.cp}: a KV cache split over cp holds no window of "
                          f"positions, and this model attends a sliding window of "
                          f"{cfg.sliding_window}; generate it without --cp")
    sampling = SamplingParams(gen.temperature, gen.top_k, gen.top_p, gen.seed)
    sampling.check()
    if gen.batching not in ("continuous", "static"):
        raise HpcparError(f"generate.batching must be 'continuous' or 'static', got "
                          f"{gen.batching!r}")
    if gen.batching == "static" and gen.batch_size:
        raise HpcparError(f"generate.batch_size {gen.batch_size} applies to continuous "
                          "batching; static batching runs every prompt of a micro-batch at "
                          "once: bound it with --micro-batches or --wave-size instead, or "
                          "drop --batching static")
    settings = GenerationSettings(gen.max_new_tokens, sampling, gen.stop_at_eos,
                                  gen.save_logits, gen.batching, gen.batch_size)
    tokenizer = load_tokenizer(ckpt)
    source = job.data.prompts
    from_file = prompts is None and source != "random"
    if prompts is None:
        if source == "random":
            lengths = job.data.random_lengths
            if len(lengths) != 2:
                raise HpcparError(f"data.random_lengths must be [min, max], got {list(lengths)}")
            prompts = random_prompts(job.data.random_count, (lengths[0], lengths[1]),
                                     cfg.vocab_size, job.data.random_seed)
        else:
            prompts = load_prompts(source, tokenizer,
                                   ChatTemplate.from_files(ckpt.tokenizer_files(), ckpt.path))
    check_prompts(prompts, cfg, settings.max_new_tokens, source)
    if job.output.path:
        inputs = {"checkpoint": ckpt.path, "prompts": source if from_file else None}
        check_output(job.output.path, inputs, kind="generation")
        if settings.save_logits and Path(job.output.path).suffix.lower() == ".jsonl":
            raise HpcparError(f"--save-logits stores the prompt logits in HDF5, and "
                              f"{job.output.path} is JSON lines; write an .h5 output for them")
    stops = StopStrings.of(gen.stop, prompts.stops, len(prompts), tokenizer)
    if stops is not None and tokenizer is None:
        raise HpcparError("stop strings are matched in the decoded text, and this checkpoint "
                          "has no tokenizer; convert the model from a folder that holds "
                          "tokenizer.json, or drop the stop strings")
    if any(s == "" for s in gen.stop):
        raise HpcparError("generate.stop holds an empty string, which every text contains; "
                          "give non-empty stop strings")
    per_prompt = prompts.sampling_for(sampling)
    if (per_prompt.temperature == 0).all() and (gen.top_k or gen.top_p != 1.0):
        raise HpcparError("top_k / top_p cut the candidates of sampling, and every prompt is "
                          "greedy (temperature 0), so they would do nothing: set "
                          "--temperature above 0, or drop them")
    return _Plan(layout, float_dtype(job.model.dtype), settings, prompts, tokenizer,
                 prompts.limits(settings.max_new_tokens), per_prompt, eos_ids(ckpt), stops)


def run_generation(comm, job: Job, prompts: Prompts | None = None,
                   progress: bool = True) -> GenerationResult | None:
    """Run ``job`` on every rank of ``comm``; returns the result on rank 0, None elsewhere.
    ``prompts`` replaces the job's ``[data]`` (for callers that hold them already)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    path = resolve_checkpoint(comm, job.model.checkpoint)
    ckpt = everyone(comm, open_checkpoint, path)
    cfg = ckpt.config
    plan = everyone(comm, _validate, job, ckpt, size, prompts)
    layout, settings = plan.layout, plan.settings
    set_timeout(job.parallel.timeout)
    with claimed(comm, job.output.path):   # one writer; the lock goes with the job
        ranks = open_stage(comm, job, layout, ckpt, plan.dtype)
        mesh, backend, stats, tp, pp = (ranks.mesh, ranks.backend, ranks.stats, ranks.tp,
                                        ranks.pp)
        world, board, stage, shard = ranks.world, ranks.board, ranks.stage, ranks.shard
        # from here a SIGTERM / SIGUSR1 asks to stop: the first stages retire every
        # micro-batch at their next forward, the finished prompts are saved, exit 3
        with StopRequest() as stop:
            eos = plan.eos
            pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
            n_prompts = len(plan.prompts)
            out = None

            def open_output():
                nonlocal out
                if rank == 0 and job.output.path:
                    shape = RunShape(_fingerprint(job, ckpt, plan), settings.max_new_tokens,
                                     np.asarray(plan.prompts.lengths, np.int64), plan.limits,
                                     cfg.vocab_size, settings.save_logits)
                    lines = None
                    if Path(job.output.path).suffix.lower() == ".jsonl":
                        lines = JsonLines(Path(job.output.path), partial(_describe, plan))
                    out = PartialOutput(job.output.path, shape, job.generate.resume, lines)

            with phase("opening the output file"):
                everyone(comm, open_output)
            done = np.zeros(n_prompts, dtype=np.int64)          # prompts a stopped run finished
            if out is not None:
                done[:] = out.done
            world.broadcast(done)
            todo = waves_of(np.flatnonzero(done == 0), job.generate.wave_size)
            bar = None
            if rank == 0 and progress and todo:
                share = sum(len(_wave_rows(w, layout.dp, 0)) for w in todo) / sum(map(len, todo))
                bar = Progress(sum(map(len, todo)), share)
            tokens = np.full((n_prompts, settings.max_new_tokens), pad_id, dtype=np.int64)
            lengths = np.zeros(n_prompts, dtype=np.int64)
            logits = None
            if rank == 0 and settings.save_logits and out is None:   # no file: held in memory
                logits = np.full((n_prompts, max(plan.prompts.lengths), cfg.vocab_size), np.nan,
                                 dtype=np.float32)
            # finished rows reach rank 0 and the file as they finish; with prompt logits,
            # the file once those are written (at the end of a wave, or of a stopped run)
            live = bool(job.output.path) and not settings.save_logits

            def received(rows, row_tokens, row_lengths):          # rank 0
                tokens[rows], lengths[rows], done[rows] = row_tokens, row_lengths, 1
                if live:
                    out.finish_rows(rows, row_tokens, row_lengths)
                    if out.failed:             # end the wave soon; reported after it
                        stop.requested = True
                if bar:
                    bar.rows_saved(len(rows))

            totals = None
            micro = 0
            for i, wave in enumerate(todo):
                figures, micro_w = _run_wave(
                    comm, world, mesh, layout, stage, plan, settings, wave, eos, pad_id,
                    backend, pp, stats, bar, out, logits, board, stop, received, ranks.cp)
                micro = max(micro, micro_w)
                totals = figures if totals is None else totals.combine(figures)
                unfinished = 0
                if rank == 0:
                    finished = done[wave] == 1
                    unfinished = int((~finished).sum())
                    if out is not None and not live and finished.any():
                        rows = wave[finished]
                        out.finish_rows(rows, tokens[rows], lengths[rows])
                if bar:
                    bar.wave_done(len(wave) - unfinished)
                failed = out is not None and out.failed is not None
                with phase("agreeing whether to go on after the wave"):
                    flag = world.all_reduce(np.array([int(stop.requested), unfinished,
                                                      int(failed)], dtype=np.int64), op="max")
                if flag[2]:                               # rank 0 could not write the output
                    if bar:
                        bar.close()
                    if rank == 0:
                        print_error(str(out.failed))
                    raise JobFailed(EXIT_INVALID)
                if flag[0] and (flag[1] or i < len(todo) - 1):
                    if bar:
                        bar.close()
                    if rank == 0:
                        kept = ("saved; run again with --resume auto to finish the rest"
                                if out is not None else "not saved (no --out)")
                        print(f"{stop.describe()}: {int(done.sum())} of "
                              f"{n_prompts} prompts are finished and {kept}", flush=True)
                    raise JobFailed(EXIT_PREEMPTED)
        if bar:
            bar.close()

        with phase("collecting the outputs on rank 0"):
            totals = replace(totals or RankFigures(), load_seconds=shard.seconds,
                             load_bytes=shard.bytes_read)
            table = world.gather(totals.to_array()[None], root=0)       # (ranks, figures)
        result = None
        if rank == 0:
            if out is not None:      # with the prompts earlier runs finished
                tokens, lengths = out.results()
            texts, stopped = decode_rows(plan.tokenizer, tokens, lengths, plan.stops)
            ran = sum(len(w) for w in todo)
            ran_tokens = sum(plan.prompts.lengths[r] for w in todo for r in w)
            new_tokens = int(sum(lengths[r] for w in todo for r in w))
            report = RunReport.build(table, layout, micro, ran, ran_tokens, new_tokens)
            reasons = finish_reasons(tokens, lengths, plan.eos, settings.stop_at_eos, stopped)
            result = GenerationResult(tokens, lengths,
                                      np.asarray(plan.prompts.lengths, dtype=np.int64), logits,
                                      texts, report, reasons)

        def write():
            if out is not None:
                attrs = _run_attrs(job, ckpt, layout, plan, backend.name, tp.kind)
                out.complete(attrs | result.report.attrs(), result.texts,
                             result.finish_reasons)

        with phase("writing the output file"):
            everyone(comm, write)     # the other ranks wait for rank 0's verdict
        ranks.close()
        return result


def waves_of(prompts: np.ndarray, wave_size: int) -> list[np.ndarray]:
    """The prompt indices ``prompts`` (increasing) in waves of ``wave_size`` (0: one wave)."""
    size = wave_size if wave_size > 0 else max(len(prompts), 1)
    return [prompts[start:start + size] for start in range(0, len(prompts), size)]


def _wave_rows(wave: np.ndarray, dp: int, dp_rank: int) -> np.ndarray:
    """The global prompt ids replica ``dp_rank`` runs in ``wave``."""
    replica = replica_rows(len(wave), dp, dp_rank)
    return wave[replica.start:replica.stop]


def _run_wave(comm, world, mesh, layout, stage, plan, settings, wave, eos, pad_id,
              backend, pp, stats, bar, out, logits, board, stop, received, cp):
    """Generate for the prompts of ``wave``; returns this rank's figures and the
    micro-batches a replica ran, once every replica has finished. Finished rows go to
    ``received`` on rank 0 (about every second, and all by the end; a stop request ends the
    wave early: the rows not finished by then are not). Prompt logits go micro-batch by
    micro-batch to the output file, or into ``logits`` (rank 0). ``cp``: the context-parallel
    group, or None."""
    rows = _wave_rows(wave, layout.dp, mesh.coord("dp"))
    mbs = micro_batches(plan.prompts.ids, rows, layout.micro_batches)
    limits, sampling = plan.limits, plan.sampling

    def on_rows(finished: int, tokens: int) -> None:       # after every step's tokens
        if bar:
            bar.rows(finished, tokens)
        stream.pump()

    continuous = settings.batching == "continuous"
    if continuous:
        width = rows_in_flight(settings, stage, mbs, limits, backend, world, cp)
        program = ContinuousProgram(stage, mbs, settings, eos, pad_id, backend, width,
                                    segment_steps(layout.pp), limits, on_rows,
                                    stop_requested=lambda: stop.requested, sampling=sampling,
                                    stops=plan.stops, cp=cp)
        pp_host = pp.on_host()
        actions = program.start_segment(pp_host)
    else:
        program = GenerationProgram(stage, mbs, settings, eos, pad_id, backend,
                                    on_rows=on_rows, limits=limits,
                                    stop_requested=lambda: stop.requested, sampling=sampling,
                                    stops=plan.stops, cp=cp)
        actions = (generation(layout.pp, len(mbs), settings.max_new_tokens)[mesh.coord("pp")]
                   if mbs else [])
    stream = FinishedRows(world, layout, board, program, settings.max_new_tokens,
                          received if world.rank == 0 else None, save_interval())
    executor = PipelineExecutor(pp, mesh.coord("pp"), program, backend, in_flight=len(mbs),
                                board=board)
    with phase("checking the pipeline schedule"):
        everyone(comm, executor.preflight, actions)
    world.barrier()
    stats.reset()
    start = perf_counter()
    fault_point("prefill")
    with phase("generating"):
        executor.run(actions)
        if continuous:
            groups = [g for g in (stage.tp, cp, pp_host) if g is not None]
            while not any_rank(stop.requested, *groups):
                actions = program.start_segment(pp_host)
                if not actions:
                    break
                executor.run(actions)
            program.finish()
        backend.synchronize()
    finished = perf_counter()
    figures = _figures(executor, program, stats, stage, backend, start, finished)
    stream.close()
    with phase("collecting the outputs on rank 0"):
        if settings.save_logits:
            _collect_logits(world, layout, plan.prompts, wave, program, out, logits)
    return figures, len(mbs)


def _fingerprint(job: Job, ckpt: Checkpoint, plan: _Plan) -> dict:
    """What a resumed run must share with the stopped one for the file to be one run's."""
    digest = hashlib.sha256()
    for ids in plan.prompts.ids:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes() + b"|")
    if plan.prompts.max_new_tokens:            # the prompts' own limits (the job's is below)
        digest.update(json.dumps(plan.prompts.max_new_tokens).encode())
    if plan.prompts.sampling:
        digest.update(json.dumps(plan.prompts.sampling, sort_keys=True).encode())
    if plan.prompts.stops:
        digest.update(json.dumps(plan.prompts.stops).encode())
    s = plan.settings
    return {
        "checkpoint": str(Path(ckpt.path).resolve()), "model": ckpt.hf_config,
        "prompts_sha256": digest.hexdigest(), "max_new_tokens": s.max_new_tokens,
        "temperature": s.sampling.temperature, "top_k": s.sampling.top_k,
        "top_p": s.sampling.top_p, "seed": s.sampling.seed, "stop_at_eos": s.stop_at_eos,
        "save_logits": s.save_logits, "wave_size": job.generate.wave_size,
        "stop": list(job.generate.stop),
        "dtype": dtype_name(plan.dtype)}


def _describe(plan: _Plan, prompt: int, row: np.ndarray, length: int):
    """A finished row's text and why it ended (for the JSON lines, row by row)."""
    texts, stopped = decode_rows(plan.tokenizer, row[None], np.array([length]), plan.stops,
                                 [prompt])
    reason = finish_reasons(row[None], np.array([length]), plan.eos,
                            plan.settings.stop_at_eos, stopped)[0]
    return (texts[0] if texts is not None else None), reason


def _figures(executor, program, stats, stage, backend, start, finished) -> RankFigures:
    t = executor.times

    def nbytes(key: str) -> int:
        op = stats.ops.get(key)
        return op.bytes if op is not None else 0

    return RankFigures(
        compute_prefill=t.compute[0], compute_decode=t.compute[1],
        wait_prefill=t.wait[0], wait_decode=t.wait[1],
        prefill_end=program.prefill_seconds(t, start), total=finished - start,
        tp_all_reduce_bytes=nbytes("tp.all_reduce"),
        tp_all_gather_bytes=nbytes("tp.all_gather"),
        pp_send_bytes=nbytes("pp.send"),
        pp_recv_bytes=nbytes("pp.recv"),
        peak_host_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        device_bytes=backend.device_memory_bytes(),
        kv_cache_bytes=sum(c.nbytes for c in program.caches),
        weight_bytes=stage.weight_bytes)


def _collect_logits(world, layout: ParallelConfig, prompts: Prompts, wave: np.ndarray,
                    program, out, logits) -> None:
    """The wave's prompt logits on world rank 0, one micro-batch at a time (to ``out``, or
    into ``logits``), sent by each replica's owner."""
    holders = owners(layout)
    if world.rank in holders and world.rank != 0:
        for mb in program.mbs:
            world.send(_prompt_logits(program, mb), 0, TAG_LOGITS)
    if world.rank != 0:
        return
    vocab = program.stage.cfg.vocab_size
    for d, owner in enumerate(holders):
        for mb in micro_batches(prompts.ids, _wave_rows(wave, layout.dp, d),
                                layout.micro_batches):
            if owner == 0:
                full = _prompt_logits(program, mb)
            else:
                full = world.recv(np.empty((mb.size, mb.length, vocab), np.float32),
                                  owner, TAG_LOGITS)
            if out is not None:
                out.write_logits(mb, full)
            else:
                unpad_into(logits, mb, full)


def _prompt_logits(program: GenerationProgram, mb) -> np.ndarray:
    """A micro-batch's prompt logits, NaN when a stop came before its prefill."""
    full = program.prompt_logits.get(mb.index)
    if full is None:
        full = np.full((mb.size, mb.length, program.stage.cfg.vocab_size), np.nan, np.float32)
    return full


def _run_attrs(job: Job, ckpt: Checkpoint, layout: ParallelConfig, plan: _Plan, backend: str,
               comm_kind: str) -> dict:
    s = plan.settings
    return {
        "hpcpar_version": __version__, "checkpoint": str(ckpt.path),
        "prompts": job.data.prompts, "dp": layout.dp, "pp": layout.pp, "tp": layout.tp,
        "micro_batches": layout.micro_batches, "max_new_tokens": s.max_new_tokens,
        "temperature": s.sampling.temperature, "top_k": s.sampling.top_k,
        "top_p": s.sampling.top_p, "seed": s.sampling.seed, "stop_at_eos": s.stop_at_eos,
        "compute_dtype": dtype_name(plan.dtype), "backend": backend, "tp_comm": comm_kind,
    }
