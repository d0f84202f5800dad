"""A training job from start to end, on every rank of ``comm``.

    validate (agreed by every rank) -> mesh and communicators -> load this rank's slices
    (from --checkpoint, or from the checkpoint --resume names, with its optimizer state)
    -> pre-flight check of the schedule -> for each step: this replica's samples, the
    pipeline schedule, dp reduction in buckets, replicated sums, one tiny AllReduce (loss,
    gradient norm, stop request), clip, optimizer step, metrics -> checkpoints -> report
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from time import perf_counter

import numpy as np

from ...checkpoint import Checkpoint, load_shard, open_checkpoint
from ...parallel.comm import create_communicator
from ..faults import fault_point
from ..generate.setup import resolve_checkpoint
from ..job import Job
from ..launch import (EXIT_INVALID, EXIT_PREEMPTED, JobFailed, StopRequest, everyone, phase,
                      print_error, set_timeout)
from ...parallel.mesh import Mesh
from ..layout import grad_rank
from ...parallel.ops import ops_for
from ..outputs import claimed
from ...parallel.context import ContextShard
from ...parallel.data_parallel import GradientReducer, local_sq_norm
from ...parallel.optim import STATE_NAMES, LossScaler, Optimizer, clip_coefficient
from ...parallel.optim_settings import learning_rate
from ...parallel.pipeline.executor import PipelineExecutor
from ...parallel.pipeline.training_schedules import training_schedule
from ..runtime import open_runtime
from ...models.tensors import stage_tensors
from . import checkpoint as tc
from .chunk import Batch, ModelChunk
from .data import label_count, make_batches, sample_indices
from .grads import sum_replicated
from .params import kv_replicas, make_params
from .program import TrainingProgram
from .report import Metrics, StepRecord, TrainFigures, TrainReport, flops_per_token, peak_flops
from .setup import TrainPlan, chunk_layers, validate
from .zero import ZeroShards


def run_training(comm, job: Job, progress: bool = True) -> TrainReport | None:
    """Run ``job`` on every rank of ``comm``; returns the report on rank 0, None elsewhere.
    Raises ``JobFailed(EXIT_PREEMPTED)`` on every rank after saving when asked to stop."""
    rank, size = comm.Get_rank(), comm.Get_size()
    path = resolve_checkpoint(comm, job.model.checkpoint)
    ckpt = everyone(comm, open_checkpoint, path)
    cfg, tr = ckpt.config, job.train
    with phase("checking the training job"):
        plan = everyone(comm, validate, job, ckpt, size)
    set_timeout(job.parallel.timeout)
    layout, V = plan.layout, plan.virtual_stages
    if plan.start_step >= tr.steps:
        if rank == 0:
            print(f"nothing to do: the checkpoint is at step {plan.start_step} >= steps "
                  f"{tr.steps}")
        return None

    with claimed(comm, plan.out_dir, folder=True):   # one job writes this folder
        if rank == 0:
            tc.remove_partial(plan.out_dir)
        rt = open_runtime(comm, job, layout, plan.dtype, data_parallel=True)
        mesh, backend, stats = rt.mesh, rt.backend, rt.stats
        tp, pp, dp, cp, world, board = rt.tp, rt.pp, rt.dp, rt.cp, rt.world, rt.board
        xp, timeout = backend.xp, job.parallel.timeout
        kv_comm = _kv_group(mesh, cfg, backend, stats, timeout)

        with phase("loading the checkpoint"):
            chunks, params, states = _load(comm, mesh, plan, ckpt, tp, backend,
                                           recompute=tr.recompute == "full", cp=cp)
        tied_peer = None
        holds_embedding = mesh.is_first("pp") or mesh.is_last("pp")
        if cfg.tie_word_embeddings and layout.pp > 1 and holds_embedding:
            tied_peer = (pp, layout.pp - 1 if mesh.is_first("pp") else 0)
        groups = [g for chunk in reversed(chunks) for g in chunk.groups]
        # gradients are summed over every rank that holds the same weights: dp x cp
        reducer = (GradientReducer(dp, groups, xp, bucket_bytes=int(tr.bucket_mb * (1 << 20)))
                   if dp.size > 1 else None)
        zero = ZeroShards(dp, reducer, xp) if reducer and tr.zero else None
        updated = zero.segments if zero else params         # what the optimizer steps
        optimizer = Optimizer(plan.optimizer, updated, xp)
        scaler = (LossScaler(tr.loss_scale, growth_interval=tr.loss_scale_window)
                  if plan.dtype == np.float16 else None)
        # float16 gradients may overflow on purpose (the scaler then skips the step): quietly
        def overflow_is_expected():
            return (np.errstate(over="ignore", invalid="ignore") if scaler
                    else contextlib.nullcontext())
        if states is not None:
            optimizer.load_state_dict(zero.slice_state(states) if zero else states)
            attrs = plan.resume[1]
            optimizer.steps = int(attrs.get("optimizer_steps", plan.start_step))
            if scaler is not None and "loss_scale" in attrs:
                scaler.scale = float(attrs["loss_scale"])
                scaler.good_steps = int(attrs["good_steps"])

        # ---- the schedule, checked once: every step has the same shapes ---------------------
        B, M = tr.global_batch, layout.micro_batches
        T = plan.dataset.seq_len
        mb_rows = B // (layout.dp * M)
        actions = training_schedule(layout.schedule, layout.pp, M, V)[mesh.coord("pp")]
        T_here = _shard(T, mesh).local_length() if layout.cp > 1 else T     # this rank's
        shape_only = [Batch(np.zeros((mb_rows, T_here), np.int64), None, None, None)] * M
        executor = PipelineExecutor(pp, mesh.coord("pp"), TrainingProgram(
            chunks, shape_only, layout.pp, mesh.coord("pp"), cfg.hidden_size, plan.dtype, xp),
            backend, in_flight=M * V, board=board)
        with phase("checking the pipeline schedule"):
            everyone(comm, executor.preflight, actions)

        metrics = everyone(comm, Metrics, plan.out_dir / "metrics.jsonl", rank == 0,
                           plan.start_step)
        per_token = flops_per_token(cfg, T)
        peak = tr.peak_tflops * 1e12 if tr.peak_tflops else peak_flops(xp, backend)
        figures = TrainFigures()
        bar = _progress_bar(rank == 0 and progress, tr.steps - plan.start_step)
        world.barrier()
        stats.reset()
        step = plan.start_step
        saved_at = step
        with StopRequest() as stop, phase("training"):
            while step < tr.steps:
                step += 1
                fault_point("train", step)
                start = perf_counter()
                first_sample = plan.samples_start + (step - plan.start_step - 1) * B
                scale = scaler.scale if scaler else 1.0
                batches = _replica_batches(plan, mesh, first_sample, B, tr, xp, scale)
                for p in params:
                    p.grad[...] = 0
                if reducer:
                    reducer.start_step()
                overlap = reducer.grads_done if reducer and not zero else None
                program = TrainingProgram(chunks, batches, layout.pp, mesh.coord("pp"), cfg.hidden_size,
                                          plan.dtype, xp, overlap)
                executor.program = program
                with overflow_is_expected():
                    executor.run(actions)
                t_reduce = perf_counter()
                if zero:                      # replicated sums first, then each rank its piece
                    sum_replicated(params, kv_comm, tied_peer, xp, tp)
                    zero.reduce_scatter()
                else:
                    if reducer:
                        reducer.finish()
                    sum_replicated(params, kv_comm, tied_peer, xp, tp)
                backend.synchronize()
                figures.reduce += perf_counter() - t_reduce
                counts_loss = chunks[-1].last and mesh.coord("tp") == 0
                agreed = np.array([program.loss if counts_loss else 0.0,
                                   local_sq_norm(updated, xp)
                                   if zero or grad_rank(mesh) == 0 else 0.0,
                                   1.0 if stop.requested else 0.0])
                world.all_reduce(agreed)
                loss, norm = float(agreed[0]) / scale, math.sqrt(agreed[1]) / scale
                stopping = agreed[2] > 0
                # float16 gradients that overflowed: skip the step and lower the loss scale
                overflow = scaler is not None and math.isfinite(loss) and not math.isfinite(norm)
                if not overflow and not (math.isfinite(loss) and math.isfinite(norm)):
                    if rank == 0:                                  # the same on every rank
                        print_error(_diverged(step, loss, norm, plan.out_dir, saved_at))
                    raise JobFailed(EXIT_INVALID)
                lr = learning_rate(plan.optimizer, step, tr.steps)
                if scaler is not None:
                    scaler.update(overflow)
                if not overflow:
                    coef = clip_coefficient(norm, plan.optimizer.clip_grad)
                    optimizer.step(lr, coef / scale)     # refreshes 16-bit copies
                    if zero:                  # the updated pieces gathered, then copied
                        zero.all_gather()
                        for p in params:
                            p.refresh()
                backend.synchronize()
                seconds = perf_counter() - start
                figures.add_step(executor.times, program.peak_held, program.peak_held_full, seconds)
                executor.times.compute[0] = executor.times.wait[0] = 0.0
                tokens = B * T
                rate = tokens / seconds
                record = StepRecord(step, loss, None if overflow else norm, lr, tokens, seconds,
                                    rate, rate * per_token / (size * peak),
                                    scaler.scale if scaler else None)
                everyone(comm, metrics.write, record)     # rank 0 writes; a failure ends all
                if bar:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}")
                elif rank == 0 and progress:
                    print(metrics.line(), flush=True)
                if stopping or step == tr.steps or (tr.save_every and step % tr.save_every == 0):
                    with phase(f"saving the checkpoint of step {step}"):
                        _save(comm, mesh, plan, ckpt, params, optimizer, zero, scaler, step,
                              first_sample + B, job, backend)
                    saved_at = step
                if stopping and step < tr.steps:
                    if bar:
                        bar.close()
                    if rank == 0:
                        print(f"{stop.describe(f'at step {step}')}; saved "
                              f"{plan.out_dir / tc.checkpoint_name(step)}; run again with "
                              "--resume auto to continue", flush=True)
                    raise JobFailed(EXIT_PREEMPTED)
        if bar:
            bar.close()
        figures.set_comm(stats, reducer)
        table = world.gather(figures.to_array()[None], root=0)               # (ranks, figures)
        if kv_comm is not None:
            kv_comm.mpi_comm.Free()
        rt.close()
        if rank != 0:
            return None
        return TrainReport.build(table, layout, V, plan.start_step, step, B * T, metrics)


def _load(comm, mesh: Mesh, plan: TrainPlan, ckpt: Checkpoint, tp, backend, recompute: bool,
          cp=None):
    """This rank's model chunks, their parameters (from --checkpoint, or from the checkpoint
    being resumed) and, when resuming, the optimizer state of those parameters."""
    cfg, layout, V, xp = ckpt.config, plan.layout, plan.virtual_stages, backend.xp
    source = plan.resume[0] if plan.resume else ckpt
    ops = ops_for(backend, cp)
    chunks, params, all_specs = [], [], []
    for c, layers in enumerate(chunk_layers(cfg.num_hidden_layers, layout, mesh.coord("pp"), V)):
        v = c * layout.pp + mesh.coord("pp")
        first, last = v == 0, v == layout.pp * V - 1
        specs = stage_tensors(cfg, layers, first, last)
        fault_point("load")
        shard = everyone(comm, load_shard, source, specs, mesh.coord("tp"), layout.tp, np.float32,
                         backend)
        chunk_params = make_params(cfg, specs, shard.tensors, xp, mesh.coord("tp"), layout.tp,
                                   last_stage_tied_copy=last and not first, dtype=plan.dtype)
        chunks.append(ModelChunk(cfg, chunk_params, layers, first, last, tp, ops, recompute))
        params += chunk_params.values()
        all_specs += specs
    states = None
    if plan.resume:
        states = everyone(comm, tc.load_optimizer_state, plan.resume[0], all_specs,
                          STATE_NAMES[plan.optimizer.optimizer], mesh.coord("tp"), layout.tp,
                          backend)
    backend.release_unused_device_memory()
    return chunks, params, states


def _replica_batches(plan: TrainPlan, mesh: Mesh, first_sample: int, B: int, tr, xp,
                     loss_scale: float = 1.0):
    """This replica's micro-batches of the global batch starting at ``first_sample``, each
    label weighted by loss_scale / (labels in the whole global batch); under context
    parallelism, this rank's positions of each row."""
    dp = plan.layout.dp
    rows = np.asarray(plan.dataset.samples[sample_indices(first_sample, B, len(plan.dataset),
                                                          tr.shuffle, tr.seed)], np.int64)
    mine = rows[mesh.coord("dp") * B // dp:(mesh.coord("dp") + 1) * B // dp]
    batches = []
    for b in make_batches(mine, plan.layout.micro_batches, label_count(rows), np.float32):
        ids, labels, weights = b.ids, b.labels, b.weights * np.float32(loss_scale)
        shard = _shard(ids.shape[1], mesh) if plan.layout.cp > 1 else None
        if shard is not None:
            rows_of = ids.shape
            ids, labels, weights = (shard.take(a.reshape(rows_of)) for a in (ids, labels, weights))
            labels, weights = labels.reshape(-1), weights.reshape(-1)
        batches.append(Batch(xp.asarray(ids), xp.asarray(b.lengths.astype(np.int32)),
                             xp.asarray(labels), xp.asarray(weights), shard))
    return batches


def _shard(length: int, mesh: Mesh) -> ContextShard:
    """This rank's part of sequences of ``length`` positions."""
    return ContextShard(length, mesh.size("cp"), mesh.coord("cp"))


def _kv_group(mesh: Mesh, cfg, backend, stats, timeout: float):
    """The tp ranks that hold the same KV head, when kv_heads < tp (else None)."""
    replicas = kv_replicas(cfg, mesh.size("tp"))
    if replicas == 1:
        return None
    sub = mesh.group("tp").mpi_comm.Split(mesh.coord("tp") // replicas, mesh.coord("tp"))
    return create_communicator(sub, "mpi", backend, stats, "kv", timeout, check=False)


def _diverged(step: int, loss: float, norm: float, out_dir: Path, saved_at: int) -> str:
    kept = (f"the last good checkpoint is {out_dir / tc.checkpoint_name(saved_at)}"
            if saved_at and (out_dir / tc.checkpoint_name(saved_at)).exists()
            else "no checkpoint was written by this run")
    return (f"step {step}: loss is {loss}, gradient norm {norm}; training stopped before the "
            f"update ({kept}); lower --lr or set --clip-grad")


def _save(comm, mesh: Mesh, plan: TrainPlan, ckpt: Checkpoint, params, optimizer,
          zero: ZeroShards | None, scaler: LossScaler | None, step: int, samples: int,
          job: Job, backend) -> None:
    """Every rank writes its counted slices in turn into one file (see ``train.checkpoint``);
    with ZeRO each replica writes the optimizer state of its own segments."""
    path = plan.out_dir / tc.checkpoint_name(step)
    tr = job.train
    attrs = {"step": step, "samples": samples, "optimizer": plan.optimizer.optimizer,
             "seed": tr.seed, "shuffle": tr.shuffle, "global_batch": tr.global_batch,
             "seq_len": plan.dataset.seq_len, "data": str(plan.dataset.source),
             "layout": plan.layout.describe(),
             "schedule": plan.layout.schedule, "lr": tr.lr,
             "optimizer_steps": optimizer.steps, "compute_dtype": job.model.dtype}
    if scaler is not None:
        attrs |= {"loss_scale": scaler.scale, "good_steps": scaler.good_steps}

    rank = comm.Get_rank()

    def create():
        if rank == 0:
            plan.out_dir.mkdir(exist_ok=True)
            tc.create_file(path, ckpt, optimizer.state_names, attrs)

    states = {name: {k: st[k] for k in optimizer.state_names}       # the step is an attribute
              for name, st in optimizer.state_dict().items()}
    to_host = backend.to_host
    tp_rank, tp_size = mesh.coord("tp"), mesh.size("tp")

    def write_mine():
        if grad_rank(mesh) == 0:
            tc.write_slices(path, params, {} if zero else states, ckpt.config, tp_rank,
                            tp_size, to_host)
        if zero:
            tc.write_segments(path, zero.segments, zero.offset, states, ckpt.config,
                              tp_rank, tp_size, to_host)

    def commit():
        if rank == 0:
            tc.commit(path)

    # each step agreed: a write that fails on any rank (a full disk) ends the job on all,
    # with one line, the temporary file removed and ``latest`` at the previous checkpoint
    try:
        everyone(comm, create)
        for r in range(comm.Get_size()):
            everyone(comm, write_mine if r == rank else lambda: None)
        everyone(comm, commit)
    except JobFailed:
        if rank == 0:
            tc.discard(path)
        raise


def _progress_bar(enabled: bool, total: int):
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="step", desc="training", leave=False)
