"""What ``--trace`` costs: the same generation and training jobs with and without a trace,
alternated, best of ``--repeats`` each, on the ranks it is started on.

    mpiexec -n 2 python benchmarks/trace.py --tp 2      # collectives in every layer
    mpiexec -n 2 python benchmarks/trace.py --pp 2      # pipeline messages
    mpiexec -n 2 python benchmarks/trace.py --tp 2 --checkpoint preset:100m

The tiny preset is the worst case: its operations take microseconds, so a span's fixed cost
(two clock reads and an append) is the largest share it can be. Times are the jobs' own
(generation: prefill + decode; training: the steps), loading and the trace's writing excluded;
the trace's size and span count are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from mpi4py import MPI

from hpcpar.jobs.generate import run_generation
from hpcpar.jobs.job import load_job
from hpcpar.jobs.train.engine import run_training


def generation(comm, args, trace: str | None) -> float:
    sets = [f"model.checkpoint='{args.checkpoint}'", f"parallel.tp={args.tp}",
            f"parallel.pp={args.pp}", f"parallel.micro_batches={2 * args.pp}",
            "data.random_count=32", "data.random_lengths=[16, 64]",
            f"generate.max_new_tokens={args.max_new}", "generate.stop_at_eos=false"]
    if trace:
        sets.append(f"output.trace='{trace}'")
    result = run_generation(comm, load_job(None, sets), progress=False)
    if result is None:
        return 0.0
    r = result.report
    return (r.prompt_tokens + r.new_tokens) / (r.prefill_seconds + r.decode_seconds)


def training(comm, args, out: Path, trace: str | None) -> float:
    sets = [f"model.checkpoint='{args.checkpoint}'", f"parallel.tp={args.tp}",
            f"parallel.pp={args.pp}", f"parallel.micro_batches={2 * args.pp}",
            "data.dataset='synthetic'", "train.seq_len=64", "train.global_batch=8",
            f"train.steps={args.steps}", f"output.path='{out}'"]
    if trace:
        sets.append(f"output.trace='{trace}'")
    report = run_training(comm, load_job(None, sets), progress=False)
    return report.tokens_per_s if report is not None else 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="preset:tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    folder = comm.bcast(tempfile.mkdtemp(prefix="hpcpar-trace-") if comm.rank == 0 else None)
    trace = os.path.join(folder, "trace.json")
    best = {("generation", False): 0.0, ("generation", True): 0.0,
            ("training", False): 0.0, ("training", True): 0.0}
    sizes = {}
    generation(comm, args, None)                     # warm-up: caches, allocator, BLAS
    for i in range(args.repeats):
        for traced in (False, True):
            key = ("generation", traced)
            best[key] = max(best[key], generation(comm, args, trace if traced else None))
            if traced and comm.rank == 0:
                sizes["generation"] = _size(trace)
            key = ("training", traced)
            run = Path(folder) / f"run-{i}-{int(traced)}"
            best[key] = max(best[key], training(comm, args, run, trace if traced else None))
            if traced and comm.rank == 0:
                sizes["training"] = _size(trace)
    if comm.rank == 0:
        cost = span_cost()
        print(f"{args.checkpoint}, tp {args.tp} x pp {args.pp} on {comm.size} ranks; "
              f"best of {args.repeats}, tokens/s; a span costs {cost * 1e6:.2f} us")
        for job in ("generation", "training"):
            off, on = best[(job, False)], best[(job, True)]
            spans, mb, seconds = sizes[job]
            print(f"  {job:<10}  untraced {off:>9,.0f}  traced {on:>9,.0f}  "
                  f"traced/untraced {on / off:.3f}   ({spans:,} spans, {mb:.1f} MB; spans x "
                  f"cost / the run's time {spans / comm.size * cost / seconds:.2%})")


def span_cost(n: int = 200_000) -> float:
    """Seconds one traced call site adds: the two clock reads and the append."""
    from time import perf_counter

    from hpcpar.parallel import trace
    tracer = trace.Tracer()
    start = perf_counter()
    for _ in range(n):
        begin = perf_counter()
        tracer.add("wait pp.recv", "wait", begin, perf_counter())
    return (perf_counter() - start) / n


def _size(path: str) -> tuple[int, float, float]:
    """Spans (all ranks), megabytes, and the seconds from the first span to the last."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e["ph"] == "X"]
    seconds = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6
    return len(events), Path(path).stat().st_size / 1e6, seconds


if __name__ == "__main__":
    main()
