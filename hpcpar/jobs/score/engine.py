"""A scoring job from start to end, on every rank of ``comm``.

    validate (agreed by every rank) -> mesh and communicators -> load this rank's slices
    -> split the rows over replicas and micro-batches -> pre-flight check of the schedule
    -> one forward pass per micro-batch through the pipeline -> collect the log-probabilities
    on rank 0 -> write the output file (atomically) -> report

The output holds ``token_logprobs`` float32 [rows, seq] (column t: log p(ids[t] | ids[:t]),
NaN where nothing is predicted: a row's first token and its padding), ``nll`` [rows] (the
sum of -log p over the row's scored tokens), ``tokens_scored`` [rows], and the attributes
``perplexity`` (exp of the total nll over the total scored tokens) and the run's figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import perf_counter

import h5py
import numpy as np

from ...checkpoint.files import (OUTPUT_KIND, AtomicPath, check_output, check_space, write_point,
                                 writing)
from ...parallel.device.dtypes import float_dtype
from ...parallel.environment import environment_value
from ...parallel.errors import HpcparError, Stopped
from ...parallel.mesh import Mesh
from ...parallel.pipeline.executor import PipelineExecutor
from ..inputs.batching import MicroBatch, micro_batches, micro_batches_of, replica_rows
from ..inputs.stage import load_tokenizer, open_stage, sequence_parallel_problem
from ..job import Job
from ..launch import everyone, phase
from ..layout import ParallelConfig
from ..progress import Progress
from ..replicas import ReplicaChannel, owners
from ..skeleton import JobRun
from .data import ScoreData, check_score_data, load_score_data
from .program import ScoringProgram, scored_tokens
from .shared_prefix import run_cost, shared_runs


@dataclass
class ScoreResult:
    """What rank 0 holds at the end (other ranks get None)."""

    token_logprobs: np.ndarray     # (rows, seq) float32, NaN where nothing is predicted
    nll: np.ndarray                # (rows,) float64
    tokens_scored: np.ndarray      # (rows,) int64
    perplexity: float
    seconds: float                 # the forward passes, loading excluded
    load_seconds: float
    shared_positions: int = 0      # positions not computed again: rows' common beginnings

    @property
    def tokens_per_s(self) -> float:
        return float(self.tokens_scored.sum()) / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        shared = (f"; {self.shared_positions} positions of rows' common beginnings computed "
                  "once" if self.shared_positions else "")
        return (f"scored {int(self.tokens_scored.sum())} tokens of {len(self.nll)} rows in "
                f"{self.seconds:.2f} s ({self.tokens_per_s:,.0f} tokens/s; loading "
                f"{self.load_seconds:.2f} s): perplexity {self.perplexity:.4f}{shared}")


@dataclass
class _CheckedScoring:
    """A scoring job as ``validate`` checked it on every rank."""
    layout: ParallelConfig
    dtype: np.dtype
    data: ScoreData


class ScoringRun(JobRun):
    """Scoring on the job skeleton. It has no step to stop at: a stop request (SIGTERM,
    SIGUSR1, Ctrl-C to any rank) ends it on every rank of the node at its next micro-batch
    or wait (``Stopped``), with nothing written."""

    kind, verb = "scoring", "score"

    def __init__(self, comm, job: Job, progress: bool = True):
        super().__init__(comm, job)
        self.progress = progress

    def validate(self) -> _CheckedScoring:
        job, ckpt = self.job, self.ckpt
        layout = job.parallel.layout(self.size)
        layout.check(ckpt.config, self.size)
        if layout.schedule != "gpipe":
            raise HpcparError(f"schedule {layout.schedule!r} is a training schedule; scoring "
                              "runs the 'gpipe' forward schedule")
        split_problem = sequence_parallel_problem(job, layout, ckpt.config)
        if split_problem:
            raise HpcparError(split_problem)
        source = job.score.data
        if not source:
            raise HpcparError("scoring needs its sequences: --data FILE (.npy ids, left-padded "
                              "with negative ids, or .jsonl of {\"ids\"} / {\"text\"})")
        data = load_score_data(source, load_tokenizer(ckpt))
        check_score_data(data, ckpt.config, source)
        longest = max(len(row) for row in data.ids)
        if longest < layout.cp:
            raise HpcparError(f"cp {layout.cp} splits each row over {layout.cp} ranks, but the "
                              f"longest row of {source} has {longest} tokens: every rank needs "
                              f"at least one; use a cp of at most {longest}")
        if not job.output.path:
            raise HpcparError("scoring needs an output file: --out OUT.h5")
        check_output(job.output.path, {"checkpoint": ckpt.path, "data": source}, kind="scores")
        check_space(job.output.path, output_bytes(len(data), data.width))   # before the work
        reason = sharing_refusal(layout.cp, None)
        if job.score.prefix_cache and reason:
            raise HpcparError(f"--prefix-cache: {reason}")
        return _CheckedScoring(layout, float_dtype(job.model.dtype), data)

    def open(self) -> None:
        self.ranks = open_stage(self.comm, self.job, self.checked.layout, self.ckpt,
                                self.checked.dtype, self._check_backend)
        self.ranks.board.stops_waits = True

    def _check_backend(self, backend) -> None:
        """An explicit ``--prefix-cache`` the backend cannot serve, before loading."""
        reason = sharing_refusal(self.checked.layout.cp, backend.on_device)
        if self.job.score.prefix_cache and reason:
            raise HpcparError(f"--prefix-cache: {reason}")

    def work(self) -> None:
        layout, ranks, world = self.checked.layout, self.ranks, self.ranks.world
        mesh, backend, stop = ranks.mesh, ranks.backend, self.stop

        def after_batch():
            channel.pump()
            if stop.requested:
                raise Stopped(stop.signal_name, stop.asked_by if stop.asked_by is not None
                              else world.rank)

        data = self.checked.data
        rows = replica_rows(len(data), layout.dp, mesh.coord("dp"))
        shares = (self.job.score.prefix_cache is not False
                  and sharing_refusal(layout.cp, backend.on_device) is None)
        mbs = (_shared_micro_batches(data, rows, layout) if shares
               else micro_batches(data.ids, rows, _micro_batch_count(data, layout)))
        done: dict[int, int] = {}           # rank 0: each replica's tokens scored

        def heard(dp_rank: int, tokens: int) -> None:
            done[dp_rank] = tokens
            self.bar.update(sum(done.values()))

        if self.rank == 0 and self.progress:
            self.bar = Progress("scoring", scored_tokens([len(r) for r in data.ids]))
        # replicas may end minutes apart; each one's owner reports its tokens scored
        channel = ReplicaChannel(world, layout, ranks.board,
                                 progress=lambda: self.program.worked,
                                 heard=heard if self.bar else None)
        self.program = ScoringProgram(ranks.stage, mbs, backend, after_batch=after_batch,
                                      cp=ranks.cp, shares=shares)
        actions = self.program.schedule(layout.pp)[mesh.coord("pp")] if mbs else []
        executor = PipelineExecutor(ranks.pp, mesh.coord("pp"), self.program, backend,
                                    in_flight=len(mbs), board=ranks.board)
        with phase("checking the pipeline schedule"):
            everyone(self.comm, executor.preflight, actions)
        world.barrier()
        start = perf_counter()
        with phase("scoring"):
            executor.run(actions)
            # the replicas of an ep group meet in every MoE layer: one with fewer micro-
            # batches serves its experts to the others until they are done
            ranks.stage.serve_experts()
            backend.synchronize()
            self.program.gather_over_cp()
        elapsed = perf_counter() - start
        channel.close()
        self.close_bar()
        self.seconds = float(world.all_reduce(np.array([elapsed]), op="max")[0])
        # every tp rank of a replica shares the same positions: each counts once
        self.shared = int(world.all_reduce(np.array([self.program.shared]), op="sum")[0]
                          ) // layout.tp

    def finish(self) -> ScoreResult | None:
        layout, ranks = self.checked.layout, self.ranks
        with phase("collecting the log-probabilities on rank 0"):
            logprobs = _collect(ranks.world, ranks.mesh, layout, len(self.checked.data),
                                self.program)
        ranks.board.stops_waits = False     # all scored: a stop now lets the output be written
        result = None
        if self.rank == 0:
            result = _result(self.checked.data, logprobs, self.seconds, ranks.shard.seconds)
            result.shared_positions = self.shared

        def write():
            if self.rank == 0:
                attrs = self.run_attrs(ranks.backend.name, ranks.tp.kind) | {
                    "data": self.job.score.data, "cp": layout.cp}
                _write(self.job.output.path, result, attrs)

        with phase("writing the output file"):
            everyone(self.comm, write)
        ranks.close()
        return result


def run_scoring(comm, job: Job, progress: bool = True) -> ScoreResult | None:
    """Run the scoring ``job`` on every rank of ``comm``; the result on rank 0, else None.
    ``progress``: rank 0 shows it (``jobs.progress``)."""
    return ScoringRun(comm, job, progress).run()


# padded tokens per micro-batch a scoring job aims at when the layout asks for fewer
# micro-batches: the activations of a whole long batch (its attention scores are
# [rows, heads, seq, seq]) leave the caches (measured on a 2-core CPU, 48 rows of 8-512
# tokens, ~100M preset: 1 micro-batch 72 tokens/s, 6: 106, 12: 135, 24: 179)
SCORE_TOKENS_PER_MICRO_BATCH = 1024


def sharing_refusal(cp: int, on_device: bool | None) -> str | None:
    """Why rows that begin alike cannot compute their beginning once here, or None:
    ``on_device``, whether the backend is a device's (None: not known yet)."""
    if cp > 1:
        return (f"cp {cp} splits every row over its ranks position by position, and a "
                "shared beginning is a run of positions: run without --cp")
    if on_device and environment_value("HPCPAR_PAGED_DEVICE") != "1":
        return ("rows sharing their beginnings have not run on a GPU yet: set "
                "HPCPAR_PAGED_DEVICE=1 to use it there")
    return None


def _micro_batch_count(data: ScoreData, layout: ParallelConfig) -> int:
    """The layout's micro-batches, or more so that each holds about
    ``SCORE_TOKENS_PER_MICRO_BATCH`` tokens (the same on every replica)."""
    rows = -(-len(data) // layout.dp)
    longest = -(-max(len(r) for r in data.ids) // layout.cp)      # positions per rank
    return max(layout.micro_batches, -(-rows * longest // SCORE_TOKENS_PER_MICRO_BATCH))


def _shared_micro_batches(data: ScoreData, rows, layout: ParallelConfig) -> list[MicroBatch]:
    """A replica's micro-batches where rows that begin alike share their beginning's pass
    (``shared_prefix``): runs of such rows are never cut, and runs are packed up to
    ``SCORE_TOKENS_PER_MICRO_BATCH`` tokens computed (a run's common prefix counted once),
    or into the layout's micro-batches where those are smaller."""
    rows = np.asarray(rows, dtype=np.int64)
    ids = [data.ids[r] for r in rows]
    runs = shared_runs(ids)
    costs = [run_cost(ids[a:b]) for a, b in runs]
    budget = min(SCORE_TOKENS_PER_MICRO_BATCH,
                 -(-sum(costs) // max(layout.micro_batches, 1)))
    sizes, size, cost = [], 0, 0
    for (a, b), c in zip(runs, costs):
        if size and cost + c > budget:
            sizes.append(size)
            size, cost = 0, 0
        size, cost = size + b - a, cost + c
    if size:
        sizes.append(size)
    return micro_batches_of(data.ids, rows, sizes)


def _collect(world, mesh: Mesh, layout: ParallelConfig, count: int,
             program: ScoringProgram) -> np.ndarray | None:
    """Every row's log-probabilities (valid-first, width the longest row's) on world rank 0,
    in input order: each replica's last stage, tp rank 0, holds its block."""
    holders = owners(layout)
    sizes = [0] * world.size
    for d, owner in enumerate(holders):
        sizes[owner] = len(replica_rows(count, layout.dp, d))
    width = world.all_reduce(np.array([program.logprobs.shape[1]]), op="max")[0]
    mine = np.full((sizes[world.rank], int(width)), np.nan, dtype=np.float32)
    if world.rank == holders[mesh.coord("dp")]:
        mine[:, :program.logprobs.shape[1]] = program.logprobs
    return world.gather(mine, root=0, sizes=sizes)


def _result(data: ScoreData, valid_first: np.ndarray, seconds: float,
            load_seconds: float) -> ScoreResult:
    """The output in the input's columns, and the per-row and total figures."""
    out = np.full((len(data), data.width), np.nan, dtype=np.float32)
    for r, (row, offset) in enumerate(zip(data.ids, data.offsets)):
        out[r, offset:offset + len(row)] = valid_first[r, :len(row)]
    scored = np.array([len(row) - 1 for row in data.ids], dtype=np.int64)
    nll = -np.nansum(out.astype(np.float64), axis=1) + 0.0     # a row with none: 0, not -0
    total = int(scored.sum())
    perplexity = math.exp(nll.sum() / total) if total else float("nan")
    return ScoreResult(out, nll, scored, perplexity, seconds, load_seconds)


def output_bytes(rows: int, width: int) -> int:
    """The output's datasets: float32 log-probabilities, float64 nll, int64 counts."""
    return rows * (width * 4 + 16)


def _write(path: str, result: ScoreResult, attrs: dict) -> None:
    check_space(path, output_bytes(*result.token_logprobs.shape))
    target = AtomicPath(path)
    try:
        with writing(path):
            with h5py.File(target.tmp, "w") as f:
                f.create_dataset("token_logprobs", data=result.token_logprobs)
                f.create_dataset("nll", data=result.nll)
                f.create_dataset("tokens_scored", data=result.tokens_scored)
                f.attrs.update(attrs | {
                    OUTPUT_KIND: "scores", "perplexity": result.perplexity,
                    "seconds": result.seconds, "tokens_per_s": result.tokens_per_s,
                    "load_seconds": result.load_seconds})
                write_point(path)
            target.commit()
    except BaseException:
        target.discard()
        raise
