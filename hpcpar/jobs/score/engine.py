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
import sys
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import h5py
import numpy as np

from ... import __version__
from ...checkpoint import Checkpoint, open_checkpoint
from ..layout import ParallelConfig
from ...parallel.dtypes import dtype_name, float_dtype
from ...parallel.errors import CommTimeout, HpcparError, Stopped
from ..generate.batching import micro_batches, replica_rows
from ..generate.setup import load_tokenizer, open_stage, resolve_checkpoint
from ..job import Job
from ..launch import EXIT_PREEMPTED, JobFailed, StopRequest, everyone, phase, set_timeout
from ...parallel.mesh import Mesh
from ...checkpoint.files import (OUTPUT_KIND, AtomicPath, check_output, check_space, write_point, writing)
from ..outputs import claimed
from ...parallel.pipeline.executor import PipelineExecutor
from ...parallel import waits
from ..generate.schedule import generation
from ..replicas import ReplicaChannel, owners
from .data import ScoreData, check_score_data, load_score_data
from .program import ScoringProgram


@dataclass
class ScoreResult:
    """What rank 0 holds at the end (other ranks get None)."""

    token_logprobs: np.ndarray     # (rows, seq) float32, NaN where nothing is predicted
    nll: np.ndarray                # (rows,) float64
    tokens_scored: np.ndarray      # (rows,) int64
    perplexity: float
    seconds: float                 # the forward passes, loading excluded
    load_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return float(self.tokens_scored.sum()) / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        return (f"scored {int(self.tokens_scored.sum())} tokens of {len(self.nll)} rows in "
                f"{self.seconds:.2f} s ({self.tokens_per_s:,.0f} tokens/s; loading "
                f"{self.load_seconds:.2f} s): perplexity {self.perplexity:.4f}")


@dataclass
class _Plan:
    layout: ParallelConfig
    dtype: np.dtype
    data: ScoreData


def _validate(job: Job, ckpt: Checkpoint, world_size: int) -> _Plan:
    layout = job.parallel.layout(world_size)
    layout.check(ckpt.config, world_size)
    if layout.schedule != "gpipe":
        raise HpcparError(f"schedule {layout.schedule!r} is a training schedule; scoring runs "
                          "the 'gpipe' forward schedule")
    source = job.score.data
    if not source:
        raise HpcparError("scoring needs its sequences: --data FILE (.npy ids, left-padded "
                          "with negative ids, or .jsonl of {\"ids\"} / {\"text\"})")
    data = load_score_data(source, load_tokenizer(ckpt))
    check_score_data(data, ckpt.config, source)
    longest = max(len(row) for row in data.ids)
    if longest < layout.cp:
        raise HpcparError(f"cp {layout.cp} splits each row over {layout.cp} ranks, but the "
                          f"longest row of {source} has {longest} tokens: every rank needs at "
                          f"least one; use a cp of at most {longest}")
    if not job.output.path:
        raise HpcparError("scoring needs an output file: --out OUT.h5")
    check_output(job.output.path, {"checkpoint": ckpt.path, "data": source}, kind="scores")
    check_space(job.output.path, output_bytes(len(data), data.width))   # before the work
    return _Plan(layout, float_dtype(job.model.dtype), data)


def run_scoring(comm, job: Job) -> ScoreResult | None:
    """Run the scoring ``job`` on every rank of ``comm``; the result on rank 0, else None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ckpt = everyone(comm, open_checkpoint, resolve_checkpoint(comm, job.model.checkpoint))
    plan = everyone(comm, _validate, job, ckpt, size)
    set_timeout(job.parallel.timeout)
    try:
        with claimed(comm, job.output.path):
            return _score(comm, job, ckpt, plan)
    except Stopped as e:          # the output's lock and temporary file are gone by now
        if rank == 0:
            print(f"hpcpar: stopped on request ({e}) while scoring: nothing was written; run "
                  "it again to score", file=sys.stderr, flush=True)
        _leave_together(comm)
        raise JobFailed(EXIT_PREEMPTED) from None


def _leave_together(comm, seconds: float = 10.0) -> None:
    """Every stopped rank waits for the others before it exits: the launcher kills what
    is left of a job once one rank has ended with a failing status, which would cut a
    rank's own clean-up short. Ranks that never heard of the stop (another node's) are
    not waited for past ``seconds``."""
    alarm = waits.current_alarm()
    waits.listen_for_alarm(None)                # the stop it would raise is known
    try:
        waits.wait_bounded(comm.Ibarrier(), seconds, "leaving after the stop")
        _drop_messages_in_flight(comm)
    except CommTimeout:
        pass
    finally:
        waits.listen_for_alarm(alarm)


def _drop_messages_in_flight(comm) -> None:
    """Receive and drop what the other ranks sent this one before they stopped (a replica's
    results or heartbeat, rank 0's pings), all of it here once they have passed the barrier:
    MPI_Finalize fails on a message left unmatched, and mpiexec then takes the rank for
    crashed and kills the others, which showed as status 9 (1 stopped run in 12)."""
    from mpi4py import MPI
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        comm.Recv([np.empty(status.Get_count(MPI.BYTE), np.uint8), MPI.BYTE],
                  status.Get_source(), status.Get_tag())


def _score(comm, job: Job, ckpt: Checkpoint, plan: _Plan) -> ScoreResult | None:
    """The scoring itself, inside the claimed output. Scoring has no step to stop at: a
    stop request (SIGTERM, SIGUSR1, Ctrl-C to any rank) ends it on every rank of the node
    at its next micro-batch or wait (``Stopped``), with nothing written."""
    with StopRequest() as stop:
        ranks = open_stage(comm, job, plan.layout, ckpt, plan.dtype)
        ranks.board.stops_waits = True
        return _score_on(comm, job, ckpt, plan, ranks, stop)


def _score_on(comm, job: Job, ckpt: Checkpoint, plan: _Plan, ranks,
              stop: StopRequest) -> ScoreResult | None:
    rank, layout = comm.Get_rank(), plan.layout
    mesh, backend, tp, pp, world = ranks.mesh, ranks.backend, ranks.tp, ranks.pp, ranks.world
    stage, board, shard = ranks.stage, ranks.board, ranks.shard

    def after_batch():
        channel.pump()
        if stop.requested:
            raise Stopped(stop.signal_name, stop.asked_by if stop.asked_by is not None
                          else world.rank)

    rows = replica_rows(len(plan.data), layout.dp, mesh.coord("dp"))
    mbs = micro_batches(plan.data.ids, rows, _micro_batch_count(plan.data, layout))
    channel = ReplicaChannel(world, layout, board)     # replicas may end minutes apart
    program = ScoringProgram(stage, mbs, backend, after_batch=after_batch, cp=ranks.cp)
    actions = generation(layout.pp, len(mbs), 1)[mesh.coord("pp")] if mbs else []
    executor = PipelineExecutor(pp, mesh.coord("pp"), program, backend, in_flight=len(mbs),
                                board=board)
    with phase("checking the pipeline schedule"):
        everyone(comm, executor.preflight, actions)
    world.barrier()
    start = perf_counter()
    with phase("scoring"):
        executor.run(actions)
        backend.synchronize()
        program.gather_over_cp()
    elapsed = perf_counter() - start
    channel.close()
    seconds = world.all_reduce(np.array([elapsed]), op="max")[0]

    with phase("collecting the log-probabilities on rank 0"):
        logprobs = _collect(world, mesh, layout, len(plan.data), program)
    board.stops_waits = False           # all scored: a stop now lets the output be written
    result = None
    if rank == 0:
        result = _result(plan.data, logprobs, float(seconds), shard.seconds)

    def write():
        if rank == 0:
            _write(job.output.path, result, _run_attrs(job, ckpt, layout, plan, backend.name,
                                                       tp.kind))

    with phase("writing the output file"):
        everyone(comm, write)
    ranks.close()
    return result


# padded tokens per micro-batch a scoring job aims at when the layout asks for fewer
# micro-batches: the activations of a whole long batch (its attention scores are
# [rows, heads, seq, seq]) leave the caches (measured on a 2-core CPU, 48 rows of 8-512
# tokens, ~100M preset: 1 micro-batch 72 tokens/s, 6: 106, 12: 135, 24: 179)
SCORE_TOKENS_PER_MICRO_BATCH = 1024


def _micro_batch_count(data: ScoreData, layout: ParallelConfig) -> int:
    """The layout's micro-batches, or more so that each holds about
    ``SCORE_TOKENS_PER_MICRO_BATCH`` tokens (the same on every replica)."""
    rows = -(-len(data) // layout.dp)
    longest = -(-max(len(r) for r in data.ids) // layout.cp)      # positions per rank
    return max(layout.micro_batches, -(-rows * longest // SCORE_TOKENS_PER_MICRO_BATCH))


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
    nll = -np.nansum(out.astype(np.float64), axis=1)
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


def _run_attrs(job: Job, ckpt: Checkpoint, layout: ParallelConfig, plan: _Plan, backend: str,
               comm_kind: str) -> dict:
    return {"hpcpar_version": __version__, "checkpoint": str(Path(ckpt.path)),
            "data": job.score.data, "dp": layout.dp, "pp": layout.pp, "tp": layout.tp,
            "cp": layout.cp, "micro_batches": layout.micro_batches,
            "compute_dtype": dtype_name(plan.dtype),
            "backend": backend, "tp_comm": comm_kind}
