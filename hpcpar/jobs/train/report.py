"""What a training run reports: a line and a ``metrics.jsonl`` row per step on rank 0, and the
end-of-run report built from every rank's figures.

MFU counts 6 N + 12 L d S FLOPs per token (N: the parameters of every matrix product, the
head included and the embedding lookup not; L layers, d hidden size, S sequence length:
the attention scores), against the peak the job gives (``peak_tflops`` per rank) or, if it
gives none, one measured by a GEMM probe on the rank's device.
"""

from __future__ import annotations

import json
import resource
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from time import perf_counter

import numpy as np

from ...checkpoint.files import write_point, write_text, writing
from ...models.config import ModelConfig
from ...models.tensors import EMBED, model_tensors
from ...parallel.pipeline.training_schedules import bubble_formula
from ..layout import ParallelConfig, by_stage


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 N + 12 L d S for one training token (forward and backward)."""
    n = sum(s.numel for s in model_tensors(cfg)
            if len(s.shape) == 2 and (s.name != EMBED or cfg.tie_word_embeddings))
    return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def peak_flops(xp, backend, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 size³ GEMM on this rank (the best of ``repeats``)."""
    a = xp.ones((size, size), dtype=xp.float32)
    best = float("inf")
    for _ in range(repeats):
        backend.synchronize()
        start = perf_counter()
        a @ a
        backend.synchronize()
        best = min(best, perf_counter() - start)
    return 2.0 * size ** 3 / best


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float | None      # None: a float16 step skipped because its gradients overflowed
    lr: float
    tokens: int
    seconds: float
    tokens_per_s: float
    mfu: float
    loss_scale: float | None = None
    aux_loss: float | None = None        # a MoE router's load-balancing loss (mean over
                                         # micro-batches, before its coefficient)
    expert_load: list | None = None      # per MoE layer, [min, max] tokens of an expert
    loss_tokens: int = 0                 # the global batch's labels that carry the loss
    fill: float | None = None            # packed rows: positions holding a sample's input

    def __post_init__(self):
        self.peak_host_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _step_of(line: str) -> int | None:
    """A metrics line's step; None for a line a failed write left torn."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class Metrics:
    """``DIR/metrics.jsonl``, one object per step, written by rank 0. On a resumed run, rows
    past the checkpoint's step (written before an interruption) are dropped first."""

    def __init__(self, path: Path, enabled: bool, resumed_at: int):
        self.path, self.enabled = path, enabled
        self.records: list[StepRecord] = []
        if enabled and path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if (step := _step_of(line)) is not None and step <= resumed_at]
            write_text(path, "".join(line + "\n" for line in keep))

    def write(self, record: StepRecord) -> None:
        self.records.append(record)
        if not self.enabled:
            return
        self.path.parent.mkdir(exist_ok=True)
        row = asdict(record) | {"peak_host_mb": record.peak_host_mb}
        for key in ("loss_scale", "aux_loss", "expert_load", "fill"):
            if row[key] is None:
                del row[key]
        with writing(self.path), open(self.path, "a") as f:
            write_point(self.path)
            f.write(json.dumps(row, allow_nan=False) + "\n")

    def line(self) -> str:
        r = self.records[-1]
        norm = (f"grad norm {r.grad_norm:.3f}" if r.grad_norm is not None else
                f"gradients overflowed: step skipped, loss scale now {r.loss_scale:g}")
        return (f"step {r.step}: loss {r.loss:.4f} over {r.loss_tokens:,} tokens, {norm}, "
                f"lr {r.lr:.3g}, {r.tokens_per_s:,.0f} tokens/s, MFU {r.mfu:.1%}, "
                f"peak host {r.peak_host_mb:.0f} MB")


@dataclass
class TrainFigures:
    """One rank's totals over the run."""

    compute: float = 0.0
    wait: float = 0.0
    reduce: float = 0.0                # dp reduction not hidden, plus the replicated sums
    seconds: float = 0.0
    peak_activation_bytes: float = 0.0
    peak_activation_full_bytes: float = 0.0     # the same without recompute (planned)
    peak_host_bytes: float = 0.0
    tp_bytes: float = 0.0
    pp_bytes: float = 0.0
    dp_bytes: float = 0.0
    dp_exposed: float = 0.0            # seconds waited for the dp reduction after the backward
    dp_buckets: float = 0.0
    dp_buckets_early: float = 0.0      # of them, started while the backward still ran
    steps: float = 0.0
    weight_bytes: float = 0.0          # what the rank holds (``weight_holders.held_bytes``)
    gradient_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    transient_bytes: float = 0.0       # ZeRO 2/3's gathered weights and gradients, at most

    def add_step(self, times, peak_held: int, peak_held_full: int, seconds: float) -> None:
        self.compute += times.compute[0]
        self.wait += times.wait[0]
        self.seconds += seconds
        self.peak_activation_bytes = max(self.peak_activation_bytes, peak_held)
        self.peak_activation_full_bytes = max(self.peak_activation_full_bytes, peak_held_full)
        self.steps += 1

    def set_comm(self, stats, reducer) -> None:
        def total(prefix: str) -> float:
            return float(sum(s.bytes for k, s in stats.ops.items() if k.startswith(prefix)))

        self.tp_bytes, self.pp_bytes = total("tp."), total("pp.")
        self.dp_bytes = total("dp.")
        if reducer is not None:
            self.dp_exposed = reducer.exposed_seconds
            self.dp_buckets, self.dp_buckets_early = reducer.started, reducer.started_early
        self.peak_host_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def set_state(self, held: dict[str, int]) -> None:
        self.weight_bytes, self.gradient_bytes = held["weights"], held["gradients"]
        self.optimizer_bytes, self.transient_bytes = held["optimizer"], held["transient"]

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))


@dataclass
class TrainReport:
    layout: str
    schedule: str
    steps: int
    tokens_per_s: float
    first_loss: float
    last_loss: float
    bubble_measured: float
    bubble_formula: float
    stage_compute_s: list[float]
    stage_wait_s: list[float]
    stage_reduce_s: list[float]
    peak_activation_mb: list[float]
    peak_activation_full_mb: list[float]
    peak_host_mb: list[float]
    state_mb: list[list[float]]        # per rank: weights, gradients, optimizer, ZeRO transient
    tp_bytes: float
    pp_bytes: float
    dp_bytes: float
    dp_buckets: int                    # gradient buckets reduced, all ranks and steps
    dp_buckets_early: int              # of them, started while the backward still ran
    dp_overlap: str
    loss_tokens: int = 0               # labels that carried the loss, over the run's steps
    tokens: int = 0                    # positions computed, over the run's steps
    data: str = ""                     # what reading fine-tuning rows found

    @classmethod
    def build(cls, table: np.ndarray, layout: ParallelConfig, virtual_stages: int,
              start_step: int, end_step: int, tokens_per_step: int,
              metrics: Metrics, data: str = "", settings: str = "") -> "TrainReport":
        """``settings``: how the layout's work was split beyond it (ZeRO, sequence
        parallelism), said on the layout line."""
        ranks = [TrainFigures(*(float(v) for v in row)) for row in table]
        stages = by_stage(ranks, layout)

        def mean(values):
            return float(np.mean(values)) if values else 0.0

        compute = [mean([f.compute for f in g]) for g in stages]
        wait = [mean([f.wait for f in g]) for g in stages]
        busy = [c + w for c, w in zip(compute, wait)]
        seconds = max(f.seconds for f in ranks)
        recs = metrics.records
        return cls(
            layout=layout.describe()
                   + (f", {virtual_stages} chunks per stage" if virtual_stages > 1 else "")
                   + settings,
            schedule=f"{layout.schedule}, {layout.micro_batches} micro-batch(es)",
            steps=end_step - start_step,
            tokens_per_s=tokens_per_step * (end_step - start_step) / seconds if seconds else 0,
            first_loss=recs[0].loss if recs else float("nan"),
            last_loss=recs[-1].loss if recs else float("nan"),
            bubble_measured=mean([w / b for w, b in zip(wait, busy) if b]),
            bubble_formula=bubble_formula(layout.schedule, layout.pp, layout.micro_batches,
                                          virtual_stages),
            stage_compute_s=compute, stage_wait_s=wait,
            stage_reduce_s=[mean([f.reduce for f in g]) for g in stages],
            peak_activation_mb=[f.peak_activation_bytes / 1e6 for f in ranks],
            peak_activation_full_mb=[f.peak_activation_full_bytes / 1e6 for f in ranks],
            peak_host_mb=[f.peak_host_bytes / 1e6 for f in ranks],
            state_mb=[[f.weight_bytes / 1e6, f.gradient_bytes / 1e6, f.optimizer_bytes / 1e6,
                       f.transient_bytes / 1e6] for f in ranks],
            tp_bytes=sum(f.tp_bytes for f in ranks), pp_bytes=sum(f.pp_bytes for f in ranks),
            dp_bytes=sum(f.dp_bytes for f in ranks),
            dp_buckets=int(sum(f.dp_buckets for f in ranks)),
            dp_buckets_early=int(sum(f.dp_buckets_early for f in ranks)),
            dp_overlap=_overlap(ranks),
            loss_tokens=sum(r.loss_tokens for r in recs),
            tokens=tokens_per_step * (end_step - start_step), data=data)

    def save(self, path: Path) -> None:
        """The report as JSON beside the checkpoints (for scripts and benchmarks)."""
        write_text(path, json.dumps(asdict(self), indent=1) + "\n")

    def format(self) -> str:
        lines = [f"data: {self.data}"] if self.data else []
        lines += [
            f"layout: {self.layout}; schedule {self.schedule}",
            f"{self.steps} steps, {self.tokens_per_s:,.0f} tokens/s; loss {self.first_loss:.4f}"
            f" -> {self.last_loss:.4f}; {self.loss_tokens:,} of {self.tokens:,} tokens carried "
            "the loss",
            f"bubble: {self.bubble_measured:.1%} measured (waiting / (computing + waiting)), "
            f"{self.bubble_formula:.1%} by the schedule's formula",
            "stage  compute s  waiting s  reducing s",
        ]
        lines += [f"{s:>5} {c:>10.3f} {w:>10.3f} {r:>11.3f}" for s, (c, w, r) in enumerate(
            zip(self.stage_compute_s, self.stage_wait_s, self.stage_reduce_s))]
        lines.append(f"communicated (all ranks): tp {self.tp_bytes / 1e6:.2f} MB, pp "
                     f"{self.pp_bytes / 1e6:.2f} MB, dp {self.dp_bytes / 1e6:.2f} MB")
        if self.dp_overlap:
            lines.append(self.dp_overlap)
        held, full = max(self.peak_activation_mb), max(self.peak_activation_full_mb)
        activations = f"peak activations per rank: {held:.1f} MB"
        if full > held:
            activations += f" (recompute saved {full - held:.1f} MB of {full:.1f})"
        lines.append(f"{activations}; peak host memory {min(self.peak_host_mb):.0f}-"
                     f"{max(self.peak_host_mb):.0f} MB")
        w, g, o, t = (max(rank[k] for rank in self.state_mb) for k in range(4))
        lines.append(f"per rank at most: weights {w:.1f} MB, gradients {g:.1f} MB, optimizer "
                     f"state {o:.1f} MB" + (f", ZeRO's gathered weights and gradients "
                                            f"{t:.1f} MB" if t else ""))
        return "\n".join(lines)


def _overlap(ranks: list[TrainFigures]) -> str:
    """How much of the dp reduction the backward hid, in words ('' without dp)."""
    buckets = sum(f.dp_buckets for f in ranks)
    if not buckets:
        return ""
    early = sum(f.dp_buckets_early for f in ranks)
    exposed = max(f.dp_exposed for f in ranks)
    reduce_time = max(f.reduce for f in ranks)
    return (f"dp reduction: {early / buckets:.0%} of the buckets started during the backward; "
            f"{exposed:.3f} s waited after it (the part not hidden), at most "
            f"{reduce_time:.3f} s with the replicated sums")
