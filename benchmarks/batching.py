"""Useful tokens/s of continuous batching against static batching on the same ranks, on a
realistic mix: prompt lengths drawn from 8 to 512 tokens, each prompt's max_new_tokens from
1 to the job's limit (EOS ignored, so every row asks for exactly its own limit). Then the
scoring job's throughput on the same prompts.

    python benchmarks/batching.py                       # ~100M preset, 1 rank
    mpiexec -n 2 python benchmarks/batching.py --pp 2   # any layout (all ranks run it)

Useful tokens are the new tokens the prompts asked for; the time is the report's generation
time (prefill + decode, loading excluded). Three runs, all with the same rows in flight
(``--slots``, per micro-batch):
  continuous   --batch-size SLOTS: a finished row's slot takes the next prompt at once
  static       waves of SLOTS prompts (--wave-size): the same KV-cache memory, each wave
               decoding until its longest row is done
  static-all   every prompt in flight at once (prompts / SLOTS times the KV-cache memory),
               micro-batches of SLOTS rows, each running to its longest row
Every run's tokens are checked equal to the continuous run's (greedy).

Then n samples per prompt (``--n``, default 4) against the same prompts written n times, on
the first ``--sampled-prompts`` prompts of the mix (continuous batching, sampled): the n
samples of a prompt share one prefill, so their prefill time is about that of the prompts
alone, where the repeated prompts prefill n times.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from time import perf_counter

import numpy as np
from mpi4py import MPI

from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.jobs.score import run_scoring


def mix(count: int, vocab: int, max_new: int, seed: int) -> Prompts:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 513, count)
    limits = rng.integers(1, max_new + 1, count)
    return Prompts([rng.integers(3, vocab, n) for n in lengths],
                   max_new_tokens=[int(k) for k in limits])


def generate(comm, checkpoint: str, prompts: Prompts, args, *sets) -> tuple[float, object]:
    common = [f"model.checkpoint='{checkpoint}'", f"generate.max_new_tokens={args.max_new}",
              "generate.stop_at_eos=false", f"parallel.pp={args.pp}", f"parallel.tp={args.tp}",
              "parallel.dp=1"]
    result = run_generation(comm, load_job(None, common + list(sets)), prompts=prompts,
                            progress=False)
    if result is None:
        return 0.0, None
    r = result.report
    return r.new_tokens / max(r.prefill_seconds + r.decode_seconds, 1e-9), result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="preset:100m")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8, help="rows in flight per micro-batch")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--sampled-prompts", type=int, default=8)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.jobs.runtime import resolve_checkpoint
    checkpoint = str(resolve_checkpoint(comm, args.checkpoint))
    vocab = open_checkpoint(checkpoint).config.vocab_size
    prompts = mix(args.prompts, vocab, args.max_new, args.seed)
    mbs = args.pp                                   # one micro-batch per stage in flight
    wanted = int(sum(prompts.max_new_tokens))
    rows = {}
    rows["continuous"] = generate(comm, checkpoint, prompts, args,
                                  f"generate.batch_size={args.slots}",
                                  f"parallel.micro_batches={mbs}")
    rows["static"] = generate(comm, checkpoint, prompts, args, "generate.batching='static'",
                              f"generate.wave_size={args.slots * mbs}",
                              f"parallel.micro_batches={mbs}")
    rows["static-all"] = generate(comm, checkpoint, prompts, args, "generate.batching='static'",
                                  f"parallel.micro_batches={-(-args.prompts // args.slots)}")
    sampled = samples_against_repeats(comm, checkpoint, prompts, args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = comm.bcast(tmp if rank0 else None)
        data = Path(tmp) / "rows.jsonl"
        if rank0:
            data.write_text("".join(json.dumps({"ids": p.tolist()}) + "\n" for p in prompts.ids))
        comm.barrier()
        sets = [f"model.checkpoint='{checkpoint}'", f"score.data='{data}'",
                f"output.path='{Path(tmp) / 'scores.h5'}'", f"parallel.pp={args.pp}",
                f"parallel.tp={args.tp}", "parallel.dp=1"]
        start = perf_counter()
        scored = run_scoring(comm, load_job(None, sets))
        wall = perf_counter() - start
        comm.barrier()
    if not rank0:
        return
    ref = rows["continuous"][1]
    print(f"{args.checkpoint}: {args.prompts} prompts of 8-512 tokens, max_new_tokens 1-"
          f"{args.max_new} each ({wanted} new tokens asked), {args.slots} rows in flight per "
          f"micro-batch, pp {args.pp} x tp {args.tp}, {comm.Get_size()} ranks")
    for name, (rate, result) in rows.items():
        same = result.tokens.tolist() == ref.tokens.tolist()
        print(f"  {name:<11} {rate:10,.1f} useful tokens/s   {rate / rows['static'][0]:5.2f}x "
              f"static   tokens {'equal' if same else 'DIFFER'}")
    print(f"  scoring     {scored.tokens_per_s:10,.0f} tokens/s scored "
          f"({int(scored.tokens_scored.sum())} tokens, {scored.seconds:.2f} s; "
          f"{wall:.2f} s with loading)")
    (n_samples, repeated), k = sampled, args.sampled_prompts
    print(f"{k} prompts x {args.n} samples (--n {args.n}) against the {k} prompts written "
          f"{args.n} times, max_new_tokens {SAMPLED_NEW}, sampled:")
    for name, r in (("--n", n_samples), ("repeated", repeated)):
        print(f"  {name:<11} prefill {r.prefill_seconds:7.3f} s   decode "
              f"{r.decode_seconds:7.3f} s   {r.new_tokens} new tokens   "
              f"{r.prefill_seconds / repeated.prefill_seconds:5.2f}x the repeated prefill")


SAMPLED_NEW = 16


def samples_against_repeats(comm, checkpoint: str, prompts: Prompts, args):
    """The reports of n samples of the first prompts, and of those prompts n times each."""
    first = prompts.ids[:args.sampled_prompts]
    sets = ["generate.temperature=1.0", "generate.seed=1", f"generate.batch_size={args.slots}",
            f"parallel.micro_batches={args.pp}"]
    limited = argparse.Namespace(**dict(vars(args), max_new=SAMPLED_NEW))
    _, n_samples = generate(comm, checkpoint, Prompts(first), limited, *sets,
                            f"generate.n={args.n}")
    _, repeated = generate(comm, checkpoint, Prompts([p for p in first for _ in range(args.n)]),
                           limited, *sets)
    return (n_samples.report, repeated.report) if n_samples is not None else (None, None)


if __name__ == "__main__":
    main()
