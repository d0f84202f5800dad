"""What a GPU would be asked to do per step, counted on the CPU.

``parallel.device.budget`` on the strict device backend counts each phase's array operations (a
kernel launch each on a GPU), device-to-host reads (each a sync), uploads, allocations and the peak
of live device bytes, for the Llama-3.2-1B and Llama-3.1-8B shapes with their layers cut down (a
layer's counts do not depend on how many there are), per run of a phase and per decoder layer.

    python benchmarks/device_budget.py                       # 1B and 8B shapes, 2 layers
    python benchmarks/device_budget.py --shapes 1b --train   # and a training step's
    python benchmarks/device_budget.py --shapes 1b --train --fused-optimizer
    mpiexec -n 2 python benchmarks/device_budget.py --tp 2   # a layout: its staged copies

Beside each generation table, the plan's prediction of rank 0's peak (``hpcpar plan``'s
weights + KV cache + activations, ``jobs.generate.memory``) and the measured one.

The arrays are float32 NumPy arrays under the strict backend's wrapper, and the ops are the
GPU's table (``HPCPAR_OPS=device``, ``parallel.ops.counted``): each device kernel runs its
NumPy reference and counts as the one launch it is (``--native``: every operation of the
references instead). So the counts are those of the GPU's code path as it stands, the bytes
those of float32 (bfloat16: half). The table is the median over the runs of each phase
(decode: every step after the first).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from statistics import median

from mpi4py import MPI

from hpcpar.checkpoint import init_checkpoint, open_checkpoint, preset_config
from hpcpar.jobs.generate import Prompts, random_prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.jobs.layout import ParallelConfig
from hpcpar.jobs.plan import plan_stages
from hpcpar.parallel.device.budget import Budget, Counts

SHAPES = {"1b": "llama3-1b", "8b": "llama3-8b"}
def typical(runs: list[Counts], skip_first: bool = False) -> Counts | None:
    """The median run of a phase (each count's own median)."""
    runs = runs[1:] if skip_first and len(runs) > 1 else runs
    if not runs:
        return None
    return Counts(**{f.name: int(median(getattr(r, f.name) for r in runs))
                     for f in fields(Counts)})


def layout(args) -> list[str]:
    """The job settings of the run's layout on the strict backend (dp: the other ranks)."""
    return ["parallel.backend='strict'", f"parallel.tp={args.tp}", f"parallel.pp={args.pp}"]


def generation_budget(checkpoint: Path, args, batching: str) -> tuple[Budget, object, str]:
    """The run's budget, its result, and the plan's prediction of rank 0's peak beside the
    measured one."""
    job = load_job(None, [f"model.checkpoint='{checkpoint}'", *layout(args),
                          f"generate.max_new_tokens={args.new_tokens}",
                          "generate.stop_at_eos=false", f"generate.batching='{batching}'"])
    cfg = open_checkpoint(checkpoint).config
    prompts = random_prompts(args.batch, (args.prompt, args.prompt), min(1000, cfg.vocab_size),
                             seed=1)
    budget = Budget()
    with budget.counting():
        result = run_generation(MPI.COMM_WORLD, job, prompts=Prompts(prompts.ids),
                                progress=False)
    world = MPI.COMM_WORLD.Get_size()
    planned = plan_stages(cfg, ParallelConfig(dp=world // (args.tp * args.pp), pp=args.pp,
                                              tp=args.tp),
                          args.batch, args.prompt, args.new_tokens, 4, job.generate)[0]
    return budget, result, (
        f"plan (rank 0): weights {planned.weight_bytes / 1e6:.0f} MB + KV cache "
        f"{planned.kv_cache_bytes / 1e6:.1f} MB + activations "
        f"{planned.activation_bytes / 1e6:.1f} MB (loading: + {planned.loading_bytes / 1e6:.1f}"
        f" MB) = peak {planned.peak_bytes / 1e6:.0f} MB; measured {budget.peak / 1e6:.0f} MB "
        f"= {budget.peak / planned.peak_bytes:.3f}x the plan")


def training_budget(checkpoint: Path, args, out: Path) -> Budget:
    from hpcpar.jobs.train.engine import run_training
    job = load_job(None, [f"model.checkpoint='{checkpoint}'", *layout(args),
                          "data.dataset='synthetic'", "train.steps=3",
                          f"train.global_batch={args.batch}", f"train.seq_len={args.prompt}",
                          f"output.path='{out}'", "parallel.micro_batches=1",
                          f"train.fused={str(args.fused_optimizer).lower()}"])
    budget = Budget()
    with budget.counting():
        run_training(MPI.COMM_WORLD, job, progress=False)
    return budget


def rows(budget: Budget, phases: list[tuple[str, str, bool]]) -> list[tuple[str, Counts]]:
    out = []
    for label, path, skip_first in phases:
        counts = typical(budget.per_run(path), skip_first)
        if counts is not None:
            out.append((label, counts))
    return out


def table(title: str, lines: list[tuple[str, Counts]]) -> str:
    head = (f"{'':<24} {'ops':>7} {'reads':>6} {'uploads':>8} {'staged':>7} {'allocs':>7} "
            f"{'alloc MB':>9} {'peak MB':>9}")
    text = [title, head]
    for label, c in lines:
        text.append(f"{label:<24} {c.ops:>7} {c.reads:>6} {c.uploads:>8} {c.staged:>7} "
                    f"{c.allocations:>7} {c.allocated_bytes / 1e6:>9.1f} "
                    f"{c.peak_bytes / 1e6:>9.1f}")
    return "\n".join(text)


GENERATION_PHASES = [("prefill (a micro-batch)", "prefill", False),
                     ("  per layer", "prefill/layer", False),
                     ("decode step", "decode", True),
                     ("  per layer", "decode/layer", True)]
TRAINING_PHASES = [("forward (a micro-batch)", "train step/forward", False),
                   ("  per layer", "train step/forward/layer", False),
                   ("backward", "train step/backward", False),
                   ("  per layer", "train step/backward/layer", False),
                   ("optimizer step", "optimizer", False)]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _shapes(text: str) -> list[str]:
    shapes = text.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape {unknown[0]!r}; the shapes are "
                                         f"{', '.join(SHAPES)}")
    return shapes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_shapes, default="1b,8b",
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=_positive, default=2)
    ap.add_argument("--batch", type=_positive, default=4,
                    help="rows (prompts, training samples)")
    ap.add_argument("--prompt", type=_positive, default=32,
                    help="prompt tokens (training: seq len)")
    ap.add_argument("--new-tokens", type=_positive, default=4)
    ap.add_argument("--vocab", type=int, default=0, help="0: the shape's own")
    ap.add_argument("--train", action="store_true", help="a training step's budget too")
    ap.add_argument("--fused-optimizer", action="store_true",
                    help="the training step's optimizer as its one fused kernel")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--native", action="store_true",
                    help="count the NumPy references' every operation (not the GPU's table)")
    args = ap.parse_args(argv)
    os.environ["HPCPAR_OPS"] = "native" if args.native else "device"
    rank0 = MPI.COMM_WORLD.Get_rank() == 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = MPI.COMM_WORLD.bcast(tmp if rank0 else None)
        for shape in args.shapes:
            cfg = dict(preset_config(SHAPES[shape]), num_hidden_layers=args.layers)
            if args.vocab:
                cfg["vocab_size"] = args.vocab
            checkpoint = Path(tmp) / f"{shape}.h5"
            if rank0:
                init_checkpoint(checkpoint, cfg)
            MPI.COMM_WORLD.barrier()
            title = (f"{shape} shape ({cfg['num_hidden_layers']} of its layers, vocab "
                     f"{cfg['vocab_size']}), {MPI.COMM_WORLD.Get_size()} rank(s), tp "
                     f"{args.tp} x pp {args.pp}, {os.environ['HPCPAR_OPS']} ops, rank 0's "
                     "counts, "
                     f"{args.batch} rows x {args.prompt} prompt tokens + {args.new_tokens}")
            for batching in ("static", "continuous"):
                budget, result, planned = generation_budget(checkpoint, args, batching)
                if rank0:
                    r = result.report
                    print(table(f"{title}, {batching} batching; weights "
                                f"{max(r.weight_mb):.0f} MB, KV cache "
                                f"{max(r.kv_cache_mb):.1f} MB, whole run's peak "
                                f"{budget.peak / 1e6:.0f} MB (from loading on)",
                                rows(budget, GENERATION_PHASES)) + "\n" + planned + "\n")
            if args.train:
                budget = training_budget(checkpoint, args, Path(tmp) / f"run-{shape}")
                if rank0:
                    adamw = "AdamW, fused" if args.fused_optimizer else "AdamW"
                    print(table(f"{title}: a training step, {adamw}, {args.batch} x "
                                f"{args.prompt} tokens", rows(budget, TRAINING_PHASES)) + "\n")
            checkpoint.unlink(missing_ok=True) if rank0 else None


if __name__ == "__main__":
    from hpcpar.jobs.launch import run_guarded
    sys.exit(run_guarded(main))          # a bad setting: one line, status 2, every rank
