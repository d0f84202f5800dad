"""A generation job from start to end, on every rank of ``comm``, on the job skeleton.

    validate (agreed by every rank, ``generate.validation``) -> mesh and communicators -> load
    this rank's slices
    -> for each wave: split its prompts over replicas and micro-batches -> pre-flight check
    of the schedule -> run the pipeline -> finished rows to rank 0 and the output as they
    finish -> collect on rank 0 -> report -> write output
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from time import perf_counter

import numpy as np

from ...parallel.pipeline.executor import PipelineExecutor
from ..faults import fault_point
from ..inputs.batching import micro_batches, replica_rows
from ..inputs.prompts import Prompts
from ..inputs.schedule import generation
from ..inputs.stage import model_sampling_note, open_stage
from ..job import Job
from ..launch import EXIT_INVALID, JobFailed, everyone, phase, print_error
from ..layout import ParallelConfig
from ..replicas import owners
from ..skeleton import JobRun
from .continuous import ContinuousProgram, rows_in_flight, segment_steps
from .paged_rows import check_prefix_cache, kv_pool_blocks, pages_rows
from .decode import check_graphed_backend
from .batch_api import BatchLines, Requests
from .jsonl_output import JsonLines
from .output_file import PartialOutput, RunShape, unpad_into
from .validation import CheckedGeneration, describe_row, fingerprint, logprob_fields, validate
from .program import GenerationProgram, RowRules, any_rank
from .progress import GenerationProgress
from .report import RankFigures, RunReport
from .results import Logprobs, RowResults, Samples
from .stopping import decode_rows, finish_reasons
from .stream import FinishedRows, save_interval

TAG_LOGITS = 13


@dataclass
class GenerationResult:
    """What rank 0 holds at the end (other ranks get None)."""

    tokens: np.ndarray                    # (batch, max_new_tokens)
    lengths: np.ndarray                   # (batch,)
    prompt_lengths: np.ndarray            # (batch,)
    prompt_logits: np.ndarray | None      # (prompts, max prompt length, vocab), NaN past
                                          # the end
    texts: list[str] | None
    report: RunReport
    finish_reasons: list[str]             # eos, stop or length, by prompt
    logprobs: Logprobs | None = None      # the new tokens' (None: no prompt asked)
    prompt_logprobs: Logprobs | None = None   # the prompts' tokens' (column t: token t)
    samples: Samples | None = None        # row p * width + s is sample s of prompt p (the
                                          # rows past its own n: empty)
    requests: Requests | None = None      # a Batch API file's requests (their prompts are
                                          # the served ones')


class GenerationRun(JobRun):
    """Generation on the job skeleton: the prompts not finished yet, in waves; finished rows
    reach rank 0 and the output as they finish. A stop request ends the current wave at the
    first stages' next forward; the finished prompts are saved, and the job exits 3."""

    kind, verb = "generating", "generate"

    def __init__(self, comm, job: Job, prompts: Prompts | None = None, progress: bool = True):
        super().__init__(comm, job)
        self.prompts, self.progress = prompts, progress
        self.out = None                 # the output file, on rank 0 (None: no --out)
        self.totals, self.micro = None, 0
        self.waves = 0                  # waves started (HPCPAR_FAULT's prefill step)
        self.paged = None               # the last wave's paged rows: its cached prompts

    def validate(self) -> CheckedGeneration:
        return validate(self.job, self.ckpt, self.size, self.prompts)

    def open(self) -> None:
        self.ranks = open_stage(self.comm, self.job, self.checked.layout, self.ckpt,
                                self.checked.dtype, self._check_backend)

    def _check_backend(self, backend) -> None:
        """What the job asks of its backend, before loading: CUDA graphs' device and dtype,
        an explicit ``--prefix-cache``'s paging there."""
        checked = self.checked
        if checked.settings.cuda_graphs:
            check_graphed_backend(backend, checked.dtype, self.ckpt.config)
        check_prefix_cache(checked.settings, checked.results, checked.layout.cp,
                           backend.on_device)

    # ---- work: the waves ---------------------------------------------------------------

    def work(self) -> None:
        checked, cfg, world = self.checked, self.ckpt.config, self.ranks.world
        eos = checked.eos
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
        n_prompts = len(checked.prompts)
        note = model_sampling_note(self.ckpt, self.job.generate) if self.rank == 0 else None
        if note:
            print(note, file=sys.stderr, flush=True)
        with phase("opening the output file"):
            everyone(self.comm, self._open_output)
        self.done = np.zeros(n_prompts, dtype=np.int64)    # prompts a stopped run finished
        if self.out is not None:
            self.done[:] = self.out.done
        self.done[~checked.samples.present] = 1              # rows past a prompt's own n
        world.broadcast(self.done)
        self.todo = waves_of(np.flatnonzero(self.done == 0), self.job.generate.wave_size)
        if self.rank == 0 and self.progress and self.todo:
            self.bar = GenerationProgress(checked, np.concatenate(self.todo))
        self.results = RowResults.empty(n_prompts, checked.results, self.pad_id)
        self.logits = None
        if self.rank == 0 and checked.settings.save_logits and self.out is None:   # in memory
            self.logits = np.full((n_prompts // checked.samples.width, max(checked.prompts.lengths),
                                   cfg.vocab_size), np.nan, dtype=np.float32)
        # finished rows reach rank 0 and the file as they finish; with prompt logits,
        # the file once those are written (at the end of a wave, or of a stopped run)
        self.live = bool(self.job.output.path) and not checked.settings.save_logits
        for i, wave in enumerate(self.todo):
            self._wave_and_verdict(wave, last=i == len(self.todo) - 1)
        self.close_bar()

    def _open_output(self) -> None:
        job, checked = self.job, self.checked
        if self.rank != 0 or not job.output.path:
            return
        shape = RunShape(fingerprint(job, self.ckpt, checked), checked.results,
                         np.asarray(checked.prompts.lengths, np.int64), checked.limits,
                         self.ckpt.config.vocab_size, checked.settings.save_logits, checked.samples)
        lines, path = None, Path(job.output.path)
        if checked.prompts.requests is not None:                  # OpenAI Batch API output
            lines = BatchLines(path, checked.prompts.requests, checked.samples,
                               partial(describe_row, checked), partial(logprob_fields, checked),
                               checked.tokenizer, Path(self.ckpt.path).stem)
        elif path.suffix.lower() == ".jsonl":
            lines = JsonLines(path, partial(describe_row, checked),
                              partial(logprob_fields, checked), checked.samples)
        self.out = PartialOutput(job.output.path, shape, job.generate.resume, lines)

    def _received(self, rows, results: RowResults) -> None:          # rank 0
        self.results.put(rows, results)
        self.done[rows] = 1
        if self.live:
            self.out.finish_rows(rows, results)
            if self.out.failed:                 # end the wave soon; reported after it
                self.stop.requested = True
        if self.bar:
            self.bar.rows_finished(rows, results.lengths)

    def _wave_and_verdict(self, wave: np.ndarray, last: bool) -> None:
        """Run ``wave``, save its finished rows, and agree on whether to go on: a failed
        write ends the job (status 2), a stop with work left saves and exits 3."""
        figures, micro = self._run_wave(wave)
        self.micro = max(self.micro, micro)
        self.totals = figures if self.totals is None else self.totals.combine(figures)
        unfinished, out = 0, self.out
        if self.rank == 0:
            finished = self.done[wave] == 1
            unfinished = int((~finished).sum())
            if out is not None and not self.live and finished.any():
                rows = wave[finished]
                out.finish_rows(rows, self.results.take(rows))
        if self.bar:
            self.bar.wave_done()
        failed = out is not None and out.failed is not None
        with phase("agreeing whether to go on after the wave"):
            flag = self.ranks.world.all_reduce(
                np.array([int(self.stop.requested), unfinished, int(failed)], dtype=np.int64),
                op="max")
        if flag[2]:                                   # rank 0 could not write the output
            self.close_bar()
            if self.rank == 0:
                print_error(str(out.failed))
            raise JobFailed(EXIT_INVALID)
        if flag[0] and (flag[1] or not last):
            kept = ("saved; run again with --resume auto to finish the rest"
                    if out is not None else "not saved (no --out)")
            present = self.checked.samples.present
            what = "samples" if self.checked.samples.width > 1 else "prompts"
            self.preempted(f"{self.stop.describe()}: {int(self.done[present].sum())} of "
                           f"{int(present.sum())} {what} are finished and {kept}")

    def _run_wave(self, wave: np.ndarray) -> tuple[RankFigures, int]:
        """Generate for the prompts of ``wave``; returns this rank's figures and the
        micro-batches a replica ran, once every replica has finished. Finished rows go to
        ``_received`` on rank 0 (about every second, and all by the end; a stop request ends
        the wave early: the rows not finished by then are not). Prompt logits go
        micro-batch by micro-batch to the output file, or into ``logits`` (rank 0)."""
        ranks, checked = self.ranks, self.checked
        world, backend = ranks.world, ranks.backend
        program, actions, mbs = self._wave_program(wave)
        executor = PipelineExecutor(ranks.pp, ranks.mesh.coord("pp"), program, backend,
                                    in_flight=len(mbs), board=ranks.board)
        with phase("checking the pipeline schedule"):
            everyone(self.comm, executor.preflight, actions)
        world.barrier()
        ranks.stats.reset()
        start = perf_counter()
        self.waves += 1
        fault_point("prefill", self.waves)
        with phase("generating"):
            executor.run(actions)
            if isinstance(program, ContinuousProgram):
                self._run_segments(program, executor)
            # the replicas of an ep group meet in every MoE layer: one that is done serves
            # its experts to the others until they are done too
            ranks.stage.serve_experts()
            backend.synchronize()
        finished = perf_counter()
        figures = _figures(executor, program, ranks.stats, ranks.stage, backend, start,
                           finished)
        self.stream.close()
        with phase("collecting the outputs on rank 0"):
            if checked.settings.save_logits:
                _collect_logits(world, checked.layout, checked.prompts, wave, program, self.out,
                                self.logits, checked.samples.width)
        return figures, len(mbs)

    def _wave_program(self, wave: np.ndarray):
        """The wave's program (continuous or static batching), its first actions, its
        micro-batches; ``self.stream`` carries finished rows to rank 0."""
        ranks, checked, settings = self.ranks, self.checked, self.checked.settings
        layout, stage, backend = checked.layout, ranks.stage, ranks.backend
        rows = _wave_rows(wave, layout.dp, ranks.mesh.coord("dp"))
        mbs = micro_batches(checked.prompts.ids, rows, layout.micro_batches)
        rules = RowRules(settings, checked.eos, self.pad_id, checked.limits, checked.sampling,
                         checked.stops, checked.stop_ids, checked.results)
        if settings.batching == "continuous":
            paged = pages_rows(settings, checked.results, backend, ranks.cp)
            width = rows_in_flight(settings, stage, mbs, checked.limits, backend, ranks.world,
                                   ranks.cp, paged)
            blocks = (kv_pool_blocks(settings, stage, mbs, checked.limits, backend,
                                     ranks.world, self.comm) if paged else 0)
            program = ContinuousProgram(stage, mbs, rules, backend, width,
                                        segment_steps(layout.pp), self, ranks.cp, blocks,
                                        self.paged)
            self.paged = program.paged          # the next wave shares its cached prompts
            actions = program.start_segment(ranks.pp.on_host())
        else:
            program = GenerationProgram(stage, mbs, rules, backend, self, ranks.cp)
            actions = (generation(layout.pp, len(mbs), settings.max_new_tokens)
                       [ranks.mesh.coord("pp")] if mbs else [])
        rank0 = ranks.world.rank == 0
        self.stream = FinishedRows(ranks.world, layout, ranks.board, program,
                                   self._received if rank0 else None,
                                   save_interval(), self.bar.heard if self.bar else None)
        return program, actions, mbs

    def stepped(self) -> None:
        """After every step's tokens (``WaveEvents``): finished rows and the progress on
        their way to rank 0."""
        if self.bar:
            program = self.stream.program
            self.bar.paged(program.pool_stats(), program.prefix_stats())
            self.bar.heard(0, program.worked)
        self.stream.pump()

    def stop_requested(self) -> bool:
        return self.stop.requested

    def _run_segments(self, program: ContinuousProgram, executor: PipelineExecutor) -> None:
        """Continuous batching's later segments, until every row is done or a stop."""
        ranks = self.ranks
        pp_host = ranks.pp.on_host()
        groups = [g for g in (ranks.stage.tp, ranks.cp, pp_host) if g is not None]
        while not any_rank(self.stop.requested, *groups):
            actions = program.start_segment(pp_host)
            if not actions:
                break
            executor.run(actions)
        program.finish()

    # ---- finish: collect, report, write ------------------------------------------------

    def finish(self) -> GenerationResult | None:
        ranks, checked, world = self.ranks, self.checked, self.ranks.world
        with phase("collecting the outputs on rank 0"):
            totals = replace(self.totals or RankFigures(), load_seconds=ranks.shard.seconds,
                             load_bytes=ranks.shard.bytes_read)
            table = world.gather(totals.to_array()[None], root=0)       # (ranks, figures)
        result = self._result(table) if self.rank == 0 else None

        def write():
            if self.out is not None:
                s = checked.settings
                attrs = self.run_attrs(ranks.backend.name, ranks.tp.kind) | {
                    "prompts": self.job.data.prompts, "max_new_tokens": s.max_new_tokens,
                    **{k: v for k, v in vars(s.sampling).items() if v is not None},
                    "n": self.job.generate.n, "stop": json.dumps(list(self.job.generate.stop)),
                    "stop_token_ids": json.dumps(list(self.job.generate.stop_token_ids)),
                    "stop_at_eos": s.stop_at_eos}
                self.out.complete(attrs | result.report.attrs(), result.texts,
                                  result.finish_reasons)

        with phase("writing the output file"):
            everyone(self.comm, write)     # the other ranks wait for rank 0's verdict
        ranks.close()
        return result

    def _result(self, table: np.ndarray) -> GenerationResult:
        """Rank 0's result: every prompt's tokens (with those earlier runs finished, from
        the output), texts, finish reasons and the run's report."""
        checked, todo = self.checked, self.todo
        results = self.out.results() if self.out is not None else self.results
        tokens, lengths = results.tokens, results.lengths
        texts, stopped = decode_rows(checked.tokenizer, tokens, lengths, checked.stops)
        ran = sum(len(w) for w in todo)                         # rows: samples
        width = checked.samples.width                              # a prompt's samples: one
        prefilled = {int(r) // width for w in todo for r in w}  # prefill (as measured)
        ran_tokens = sum(checked.prompts.lengths[p * width] for p in prefilled)
        new_tokens = int(sum(lengths[r] for w in todo for r in w))
        report = RunReport.build(table, checked.layout, self.micro, len(prefilled), ran_tokens,
                                 new_tokens, ran)
        reasons = finish_reasons(tokens, lengths, checked.eos, checked.settings.stop_at_eos,
                                 stopped, checked.stop_ids)
        reasons = [r if run else "" for r, run in zip(reasons, checked.samples.present)]
        return GenerationResult(tokens, lengths, np.asarray(checked.prompts.lengths, np.int64),
                                self.logits, texts, report, reasons, results.logprobs,
                                results.prompt_logprobs,
                                checked.samples,
                                checked.prompts.requests)


def run_generation(comm, job: Job, prompts: Prompts | None = None,
                   progress: bool = True) -> GenerationResult | None:
    """Run ``job`` on every rank of ``comm``; returns the result on rank 0, None elsewhere.
    ``prompts`` replaces the job's ``[data]`` (for callers that hold them already)."""
    return GenerationRun(comm, job, prompts, progress).run()


def waves_of(prompts: np.ndarray, wave_size: int) -> list[np.ndarray]:
    """The prompt indices ``prompts`` (increasing) in waves of ``wave_size`` (0: one wave)."""
    size = wave_size if wave_size > 0 else max(len(prompts), 1)
    return [prompts[start:start + size] for start in range(0, len(prompts), size)]


def _wave_rows(wave: np.ndarray, dp: int, dp_rank: int) -> np.ndarray:
    """The global prompt ids replica ``dp_rank`` runs in ``wave``."""
    replica = replica_rows(len(wave), dp, dp_rank)
    return wave[replica.start:replica.stop]


def _figures(executor, program, stats, stage, backend, start, finished) -> RankFigures:
    t = executor.times
    prefix, pool = program.prefix_stats(), program.pool_stats()

    def nbytes(key: str) -> int:
        op = stats.ops.get(key)
        return op.bytes if op is not None else 0

    return RankFigures(
        compute_prefill=t.compute[0], compute_decode=t.compute[1],
        wait_prefill=t.wait[0], wait_decode=t.wait[1],
        prefill_end=program.prefill_seconds(t, start), total=finished - start,
        tp_all_reduce_bytes=nbytes("tp.all_reduce"),
        tp_all_gather_bytes=nbytes("tp.all_gather"),
        tp_reduce_scatter_bytes=nbytes("tp.reduce_scatter"),
        ep_all_to_all_bytes=nbytes("ep.all_to_all"),
        expert_bytes=stage.expert_bytes,
        pp_send_bytes=nbytes("pp.send"),
        pp_recv_bytes=nbytes("pp.recv"),
        peak_host_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        device_bytes=backend.device_memory_bytes() + sum(
            step.graph_bytes for step in program.decode or []),
        kv_cache_bytes=program.kv_cache_bytes(),
        prefix_prompt_tokens=prefix[0], prefix_hit_tokens=prefix[1],
        kv_blocks=pool[0], kv_blocks_peak=pool[1], preemptions=pool[2],
        rows_in_flight=program.rows_held(), weight_bytes=stage.weight_bytes)


def _collect_logits(world, layout: ParallelConfig, prompts: Prompts, wave: np.ndarray,
                    program, out, logits, width: int) -> None:
    """The wave's prompt logits on world rank 0, one micro-batch at a time (to ``out``, or
    into ``logits``, once per prompt of ``width`` samples), sent by each replica's owner."""
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
                unpad_into(logits, mb, full, width)


def _prompt_logits(program: GenerationProgram, mb) -> np.ndarray:
    """A micro-batch's prompt logits, NaN when a stop came before its prefill."""
    full = program.prompt_logits.get(mb.index)
    if full is None:
        full = np.full((mb.size, mb.length, program.stage.cfg.vocab_size), np.nan, np.float32)
    return full
