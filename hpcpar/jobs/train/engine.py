"""A training job from start to end, on every rank of ``comm``, on the job skeleton.

    validate (agreed by every rank) -> mesh and communicators -> load this rank's slices
    (from --checkpoint, or from the checkpoint --resume names, with its optimizer state)
    -> pre-flight check of the schedule -> for each step: this replica's samples, the
    pipeline schedule, dp reduction in buckets, replicated sums, one tiny AllReduce (loss,
    gradient norm, stop request), clip, optimizer step, metrics -> checkpoints -> report
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from time import perf_counter

import numpy as np

from ...parallel.device import budget
from ...parallel.errors import HpcparError
from ...parallel import trace
from ...parallel.data_parallel.reducer import local_sq_norm
from ...parallel.data_parallel.flat_buffers import spans
from ...parallel.optim.optimizers import LossScaler, Optimizer, clip_coefficient
from ...parallel.optim.settings import learning_rate
from ...parallel.pipeline.executor import PipelineExecutor
from ...parallel.pipeline.training_schedules import training_schedule
from ..faults import fault_point
from ..job import Job
from ..launch import EXIT_INVALID, JobFailed, everyone, phase, print_error
from ..layout import grad_rank
from ..runtime import open_runtime
from ..progress import Progress
from ..skeleton import JobRun
from . import checkpoint as tc
from .model_chunk import Batch
from .data import context_shard, replica_batches, step_fill
from .grads import sum_replicated
from .weight_holders import held_bytes, holders
from .params import NotHeld
from ...checkpoint.reader import PieceReader
from .sharded_units import Transient, ZeroHooks, check_alike
from .zero import ZeroShards
from .program import TrainingProgram
from .lora import AdapterSource
from .saver import CheckpointSaver
from .report import Metrics, StepRecord, TrainFigures, TrainReport, flops_per_token, peak_flops
from .setup import CheckedTraining, kv_group, load_chunks, validate


class TrainingRun(JobRun):
    """Training on the job skeleton. A stop request (SIGTERM, SIGUSR1, Ctrl-C to any rank)
    is agreed at the end of the next step: that step's checkpoint is saved and every rank
    exits 3 (``--resume auto`` continues)."""

    kind, verb = "training", "train"
    checking_phase = "checking the training job"
    output_is_folder = True

    def __init__(self, comm, job: Job, progress: bool = True):
        super().__init__(comm, job)
        self.progress = progress
        self.loss_tokens = 0                # the last step's labels that carried the loss

    def validate(self) -> CheckedTraining:
        if self.job.train.async_save and self.job.train.serial_save:
            raise HpcparError("--async-save writes every rank's part file in the background; "
                              "--serial-save writes one file, one rank at a time: choose one")
        return validate(self.job, self.ckpt, self.size)

    def has_work(self) -> bool:
        if self.checked.start_step < self.job.train.steps:
            return True
        if self.rank == 0:
            print(f"nothing to do: the checkpoint is at step {self.checked.start_step} >= steps "
                  f"{self.job.train.steps}")
        return False

    def output_path(self) -> Path:
        return self.checked.out_dir

    # ---- open: the runtime, the model's chunks, the optimizer, the schedule -------------

    def open(self) -> None:
        checked, tr = self.checked, self.job.train
        if self.rank == 0:
            tc.remove_partial(checked.out_dir)
        self.rt = rt = open_runtime(self.comm, self.job, checked.layout, checked.dtype,
                                    data_parallel=True)
        self.xp = rt.backend.xp
        self.kv_comm = kv_group(rt.mesh, self.ckpt.config, rt.backend, rt.stats,
                                 self.job.parallel.timeout)
        with phase("loading the checkpoint"):
            self.chunks, self.params, states = load_chunks(
                self.comm, rt.mesh, checked, self.ckpt, rt.tp, rt.backend,
                recompute=tr.recompute == "full", cp=rt.cp, ep=rt.ep, zero=tr.zero)
        self._open_optimizer(states)
        lora = checked.lora           # a LoRA run's checkpoints hold its adapters only
        source = (self.ckpt if lora is None
                  else AdapterSource(self.ckpt, lora.specs(self.ckpt.config)))
        self.saver = CheckpointSaver(self.comm, rt.world, source, self.ckpt.config,
                                     rt.mesh.coord("tp"), rt.mesh.size("tp"), rt.backend.to_host,
                                     serial=tr.serial_save, background=tr.async_save)
        self.saver.check_memory(self.held, self.optimizer.state_names)
        self._open_schedule()
        self.metrics = everyone(self.comm, Metrics, checked.out_dir / "metrics.jsonl",
                                self.rank == 0, checked.start_step)
        self.per_token = flops_per_token(self.ckpt.config, checked.dataset.seq_len)
        self.peak = (tr.peak_tflops * 1e12 if tr.peak_tflops
                     else peak_flops(self.xp, rt.backend))
        self.figures = TrainFigures()
        if self.rank == 0 and self.progress:
            self.bar = Progress("training", (tr.steps - checked.start_step) * self._step_tokens())
            self._show_progress(checked.start_step)

    def _open_optimizer(self, states) -> None:
        """Gradient buckets, ZeRO's shards, the optimizer and loss scaler (their state
        restored when resuming), and the peer of a tied embedding."""
        checked, tr, rt, mesh = self.checked, self.job.train, self.rt, self.rt.mesh
        self.tied_peer = None
        holds_embedding = mesh.is_first("pp") or mesh.is_last("pp")
        if (self.ckpt.config.tie_word_embeddings and checked.layout.pp > 1 and holds_embedding
                and checked.lora is None):                      # LoRA: frozen embedding
            self.tied_peer = (rt.pp, checked.layout.pp - 1 if mesh.is_first("pp") else 0)
        groups = [g for chunk in reversed(self.chunks) for g in chunk.groups]
        # gradients are summed over every rank that holds the same weights: dp x cp, and
        # with ep the experts over their own replicas (``holders``)
        self.held = holders(self.params, rt.dp, rt.edp, grad_rank(mesh) == 0)
        self.transient = Transient(self.xp)   # ZeRO 2/3: what is whole for a moment
        reader = self._piece_reader()
        with reader or contextlib.nullcontext():
            def open_groups():
                for group in self.held:
                    group.open(groups, self.xp, int(tr.bucket_mb * (1 << 20)), tr.zero,
                               checked.dtype, self.transient, reader)
            everyone(self.comm, open_groups) if reader else open_groups()
            self._open_state(states, reader)

    def _piece_reader(self) -> PieceReader | None:
        """Where ZeRO-3 reads its pieces of the params loaded as ``NotHeld`` (None: all are
        whole): the checkpoint resumed, or --checkpoint."""
        if not any(isinstance(p.master, NotHeld) for p in self.params):
            return None
        source = self.checked.resume[0] if self.checked.resume else self.ckpt
        return PieceReader(source, self.rt.mesh.coord("tp"), self.rt.mesh.size("tp"))

    def _open_state(self, states, reader) -> None:
        """ZeRO's hooks, the optimizer and the loss scaler, their state restored from
        ``states`` (the checkpoint's, when resuming; ZeRO-3's pieces read by ``reader``)."""
        checked, tr, rt = self.checked, self.job.train, self.rt
        self.zero = any(group.zero for group in self.held)
        sharded = [group.sharded for group in self.held if group.sharded]
        self.hooks = ZeroHooks(sharded) if sharded else None
        if self.hooks is not None:
            check_alike(sharded, rt.tp)
            for chunk in self.chunks:
                chunk.zero = self.hooks
        self.updated = [p for group in self.held for p in group.updated]   # what is stepped
        self.optimizer = Optimizer(checked.optimizer, self.updated, self.xp)
        self.scaler = (LossScaler(tr.loss_scale, growth_interval=tr.loss_scale_window)
                       if checked.dtype == np.float16 else None)
        if states is not None:
            def sliced():
                return {name: state for group in self.held for name, state in
                        group.slice_state(states, self.optimizer.state_names).items()}
            self.optimizer.load_state_dict(everyone(self.comm, sliced) if reader else sliced())
            attrs = checked.resume[1]
            self.optimizer.steps = int(attrs.get("optimizer_steps", checked.start_step))
            if self.scaler is not None and "loss_scale" in attrs:
                self.scaler.scale = float(attrs["loss_scale"])
                self.scaler.good_steps = int(attrs["good_steps"])

    def _open_schedule(self) -> None:
        """The pipeline schedule, checked once: every step has the same shapes."""
        checked, rt, mesh = self.checked, self.rt, self.rt.mesh
        layout, M, V = checked.layout, checked.layout.micro_batches, checked.virtual_stages
        T = checked.dataset.seq_len
        mb_rows = self.job.train.global_batch // (layout.dp * M)
        self.actions = training_schedule(layout.schedule, layout.pp, M, V)[mesh.coord("pp")]
        T_here = context_shard(T, mesh).local_length() if layout.cp > 1 else T     # this rank's
        shape_only = [Batch(np.zeros((mb_rows, T_here), np.int64), None, None, None)] * M
        self.executor = PipelineExecutor(rt.pp, mesh.coord("pp"), self._program(shape_only),
                                         rt.backend, in_flight=M * V, board=rt.board)
        with phase("checking the pipeline schedule"):
            everyone(self.comm, self.executor.preflight, self.actions)

    def _program(self, batches, overlap=None) -> TrainingProgram:
        cfg, layout = self.ckpt.config, self.checked.layout
        return TrainingProgram(self.chunks, batches, layout.pp, self.rt.mesh.coord("pp"),
                               cfg.hidden_size, self.checked.dtype, self.xp, overlap,
                               self.hooks)

    # ---- work: the steps ---------------------------------------------------------------

    def work(self) -> None:
        self.rt.world.barrier()
        self.rt.stats.reset()
        self.step = self.saved_at = self.checked.start_step
        with phase("training"):
            while self.step < self.job.train.steps:
                self._train_step()

    def _train_step(self) -> None:
        """One step: forward and backward over the schedule, gradients summed, the loss,
        norm and stop agreed, the update, its metrics, and a checkpoint where one is due."""
        tr, checked = self.job.train, self.checked
        self.step += 1
        step, B = self.step, tr.global_batch
        fault_point("train", step)
        start = perf_counter()
        first_sample = checked.samples_start + (step - checked.start_step - 1) * B
        scale = self.scaler.scale if self.scaler else 1.0
        with budget.phase("train step"):
            program = self._forward_backward(first_sample, scale)
        loss, norm, stopping = self._agree(program, scale)
        # float16 gradients that overflowed: skip the step and lower the loss scale
        overflow = self.scaler is not None and math.isfinite(loss) and not math.isfinite(norm)
        if not overflow and not (math.isfinite(loss) and math.isfinite(norm)):
            self.saver.wait()                   # a good checkpoint still being written
            if self.rank == 0:                                  # the same on every rank
                print_error(_diverged(step, loss, norm, checked.out_dir, self.saved_at))
            raise JobFailed(EXIT_INVALID)
        lr = learning_rate(checked.optimizer, step, tr.steps)
        self._update(lr, norm, scale, overflow)
        self._record(program, start, loss, None if overflow else norm, lr)
        self.saver.poll()                   # a background save all ranks finished: committed
        if stopping or step == tr.steps or (tr.save_every and step % tr.save_every == 0):
            with phase(f"saving the checkpoint of step {step}"):
                self._save(first_sample + B, final=stopping or step == tr.steps)
            self.saved_at = step
        if stopping and step < tr.steps:
            self.preempted(f"{self.stop.describe(f'at step {step}')}; saved "
                           f"{checked.out_dir / tc.checkpoint_name(step)}; run again with "
                           "--resume auto to continue")

    def _forward_backward(self, first_sample: int, scale: float) -> TrainingProgram:
        """The step's schedule run over this replica's batches, then every gradient summed
        where its copies are (dp buckets, replicated weights; ZeRO: each rank its piece)."""
        rt, zero = self.rt, self.zero
        reducers = [group.reducer for group in self.held if group.reducer]
        # the backward starts each bucket's sum as it completes: one group's buckets only
        overlap = reducers[0].grads_done if len(self.held) == 1 and reducers and not zero \
            else None
        batches, self.loss_tokens = replica_batches(
            self.checked.dataset, rt.mesh, self.checked.layout.micro_batches, first_sample,
            self.job.train, self.xp, scale)
        self.fill = step_fill(self.checked.dataset, first_sample, self.job.train)
        for span in spans(self._whole(), "grad"):   # one operation per gradient buffer
            span[...] = 0
        for group in self.held:
            if group.sharded:
                group.sharded.zero_grad()
        for reducer in reducers:
            reducer.start_step()
        program = self._program(batches, overlap)
        self.executor.program = program
        with self._overflow_is_expected():
            self.executor.run(self.actions, step=self.step)
        t_reduce = perf_counter()
        if self.hooks is not None:            # each micro-batch's pieces summed already:
            self.hooks.finish()               # what is left, then the replicated sums
            summed = self._whole() + [s for g in self.held if g.sharded for s in g.updated]
            sum_replicated(summed, self.kv_comm, self.tied_peer, self.xp, rt.tp)
        elif zero:                            # replicated sums first, then each rank its piece
            sum_replicated(self.params, self.kv_comm, self.tied_peer, self.xp, rt.tp)
            for group in self.held:
                if group.zero:
                    group.zero.reduce_scatter()
                elif group.reducer:
                    group.reducer.finish()
        else:
            for reducer in reducers:
                reducer.finish()
            sum_replicated(self.params, self.kv_comm, self.tied_peer, self.xp, rt.tp)
        rt.backend.synchronize()
        self.figures.reduce += perf_counter() - t_reduce
        return program

    def _whole(self) -> list:
        """The params whose gradients this rank holds whole (not ZeRO 2/3's)."""
        return [p for group in self.held if not group.sharded for p in group.params]

    def _overflow_is_expected(self):
        """float16 gradients may overflow on purpose (the scaler then skips the step):
        quietly."""
        return (np.errstate(over="ignore", invalid="ignore") if self.scaler
                else contextlib.nullcontext())

    def _agree(self, program: TrainingProgram, scale: float) -> tuple[float, float, bool]:
        """The step's loss and gradient norm, and whether any rank was asked to stop: one
        small AllReduce over every rank."""
        mesh = self.rt.mesh
        counts_loss = self.chunks[-1].last and mesh.coord("tp") == 0
        agreed = np.array([program.loss if counts_loss else 0.0,
                           sum(local_sq_norm(group.updated, self.xp) for group in self.held
                               if group.zero or group.first),
                           1.0 if self.stop.requested else 0.0,
                           sum(c.aux_sum for c in self.chunks) if counts_loss else 0.0])
        self.rt.world.all_reduce(agreed)
        for chunk in self.chunks:
            chunk.aux_sum = 0.0
        layout = self.checked.layout
        self.aux_loss = (float(agreed[3]) / (layout.dp * layout.micro_batches)
                         if self.checked.aux_coef else None)
        return float(agreed[0]) / scale, math.sqrt(agreed[1]) / scale, bool(agreed[2] > 0)

    def _expert_load(self) -> list | None:
        """Per MoE layer, [min, max] over the experts of the real tokens' top-k choices this
        step, every replica's summed (one small AllReduce over every rank)."""
        cfg = self.ckpt.config
        if not cfg.moe_layers:
            return None
        loads = np.zeros((cfg.num_hidden_layers, cfg.num_experts), np.int64)
        for chunk in self.chunks:
            for i, load in chunk.take_load().items():
                if self.rt.mesh.coord("tp") == 0:      # the tp ranks route alike
                    loads[i] = load
        self.rt.world.all_reduce(loads)
        return [[int(loads[i].min()), int(loads[i].max())] for i in cfg.moe_layers]

    def _update(self, lr: float, norm: float, scale: float, overflow: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(overflow)
        if not overflow:
            coef = clip_coefficient(norm, self.checked.optimizer.clip_grad)
            with trace.span("optimizer step", "compute"), budget.phase("optimizer"):
                self.optimizer.step(lr, coef / scale)     # refreshes 16-bit copies
            for group in self.held:                   # the updated pieces gathered
                if group.zero:
                    group.zero.all_gather()
                if isinstance(group.zero, ZeroShards):    # ... into masters: then copied
                    for p in group.params:
                        p.refresh()
        self.rt.backend.synchronize()

    def _record(self, program: TrainingProgram, start: float, loss: float,
                norm: float | None, lr: float) -> None:
        """The step's figures and metrics line (rank 0 writes; a failure ends all)."""
        seconds = perf_counter() - start
        times = self.executor.times
        self.figures.add_step(times, program.peak_held, program.peak_held_full, seconds)
        times.compute[0] = times.wait[0] = 0.0
        tokens = self._step_tokens()
        rate = tokens / seconds
        record = StepRecord(self.step, loss, norm, lr, tokens, seconds, rate,
                            rate * self.per_token / (self.size * self.peak),
                            self.scaler.scale if self.scaler else None, self.aux_loss,
                            self._expert_load(), self.loss_tokens, self.fill)
        everyone(self.comm, self.metrics.write, record)
        if self.bar:
            self._show_progress(self.step, loss)
            if self.bar.bar is None:        # a log: the step's line too (a bar shows the loss)
                print(self.metrics.line(), flush=True)

    def _step_tokens(self) -> int:
        return self.job.train.global_batch * self.checked.dataset.seq_len

    def _show_progress(self, step: int, loss: float | None = None) -> None:
        detail = f"step {step}/{self.job.train.steps}"
        if loss is not None:
            detail += f", loss {loss:.4f} over {self.loss_tokens:,} tokens"
        self.bar.update((step - self.checked.start_step) * self._step_tokens(), detail=detail)

    def _save(self, samples: int, final: bool = False) -> None:
        """Every writer its own slices at once (``train.saver``; in the background with
        ``--async-save`` unless ``final``). A write that fails on any rank ends the job on
        all, with one line, ``latest`` at the previous checkpoint."""
        path = self.checked.out_dir / tc.checkpoint_name(self.step)
        self.saver.save(path, self.held, self.optimizer, self._save_attrs(samples), final)

    def _save_attrs(self, samples: int) -> dict:
        checked, tr = self.checked, self.job.train
        attrs = {"step": self.step, "samples": samples, "optimizer": checked.optimizer.optimizer,
                 "seed": tr.seed, "shuffle": tr.shuffle, "global_batch": tr.global_batch,
                 "seq_len": checked.dataset.seq_len, "data": str(checked.dataset.source),
                 "pack": bool(tr.pack), "zero": tr.zero,
                 "layout": checked.layout.describe(),
                 "schedule": checked.layout.schedule, "lr": tr.lr,
                 "optimizer_steps": self.optimizer.steps, "compute_dtype": self.job.model.dtype}
        if self.scaler is not None:
            attrs |= {"loss_scale": self.scaler.scale, "good_steps": self.scaler.good_steps}
        if checked.lora is not None:
            attrs |= checked.lora.attrs(self.ckpt.path)
        return attrs

    # ---- finish: the report ------------------------------------------------------------

    def release(self) -> None:
        if getattr(self, "saver", None) is not None:
            self.saver.close()              # a background write a failure left in flight
        super().release()

    def finish(self) -> TrainReport | None:
        self.close_bar()
        self.figures.set_comm(self.rt.stats, next((g.reducer for g in self.held if g.reducer),
                                                  None))
        self.figures.set_state(held_bytes(self.held, self.optimizer, self.transient,
                                          [w for chunk in self.chunks for w in chunk.frozen]))
        table = self.rt.world.gather(self.figures.to_array()[None], root=0)  # (ranks, figures)
        if self.kv_comm is not None:
            self.kv_comm.mpi_comm.Free()
        self.rt.close()
        if self.rank != 0:
            return None
        checked = self.checked
        return TrainReport.build(table, checked.layout, checked.virtual_stages, checked.start_step,
                                 self.step, self.job.train.global_batch * checked.dataset.seq_len,
                                 self.metrics, checked.dataset.note, self._settings_note())

    def _settings_note(self) -> str:
        """ZeRO's stage and where it split (or that it had nothing to split), and sequence
        parallelism, for the report's layout line."""
        checked, zero = self.checked, self.job.train.zero
        note = ""
        if zero:
            holders = checked.layout.dp * checked.layout.cp
            note += (f"; ZeRO-{zero} over dp x cp {holders}" if holders > 1 else
                     f"; ZeRO-{zero} asked, nothing to split (dp x cp 1)")
        if checked.sequence_parallel:
            note += f"; sequence parallel over tp {checked.layout.tp}"
        return note


def run_training(comm, job: Job, progress: bool = True) -> TrainReport | None:
    """Run ``job`` on every rank of ``comm``; returns the report on rank 0, None elsewhere.
    Raises ``JobFailed(EXIT_PREEMPTED)`` on every rank after saving when asked to stop."""
    return TrainingRun(comm, job, progress).run()


def _diverged(step: int, loss: float, norm: float, out_dir: Path, saved_at: int) -> str:
    kept = (f"the last good checkpoint is {out_dir / tc.checkpoint_name(saved_at)}"
            if saved_at and (out_dir / tc.checkpoint_name(saved_at)).exists()
            else "no checkpoint was written by this run")
    return (f"step {step}: loss is {loss}, gradient norm {norm}; training stopped before the "
            f"update ({kept}); lower --lr or set --clip-grad")

