"""Checkpoint save time: one rank at a time into one file (``--serial-save``, how hpcpar
wrote them before) against every rank at once (part files under HDF5 virtual datasets, the
default), at 2, 4 and 8 ranks, and the training time ``--async-save`` hides; ratios measured
in the same run.

    python benchmarks/checkpoint_save.py                        # ~34M parameters, 410 MB
    python benchmarks/checkpoint_save.py --ranks 2,4 --hidden 256 --repeats 2      # quicker

Save time: under ``mpiexec -n N`` each rank holds its tp slices (tp N) of the model's float32
weights and of two AdamW moments, and the job's own saver writes them (``train.saver``), the
best of ``--repeats`` saves, from the barrier before to the barrier after (the slowest rank).
The parallel save syncs every part file to disk before ``latest`` names it (fsync, as
torch.distributed.checkpoint's writer does); the serial one, as before, does not, so the
parallel save is also timed without its fsyncs ("no fsync").

Hidden time: the training job (``run_training`` in the worker: no start-up in the time) on
1 rank (a core left to the writing thread, as a GPU node has them) and on 2 (tp 2: every
core computing), 64 tokens x 16 rows a step, synthetic data, ``--steps S --save-every 1``
against saving at the end only (that save is in every run), ``--train-repeats`` runs of
each, interleaved, each figure the best: the seconds rank 0's training loop spends in the
saver (writing; or snapshotting and waiting for the write before) and in its steps (which
a writing thread may slow), and the share of the extra saves' cost ``--async-save`` hides.
Each save and run starts after ``sync``, so none pays for data an earlier one left in the
page cache (an fsync on ext4 writes out other files' pending data too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def config(hidden: int, layers: int, vocab: int) -> dict:
    from hpcpar.checkpoint.presets import preset_config
    cfg = preset_config("tiny")
    heads = max(8, hidden // 64)
    return dict(cfg, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 8 * 8,
                num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=heads,
                num_key_value_heads=heads, max_position_embeddings=256)


def worker_saves(folder: Path, repeats: int) -> None:
    """Under mpiexec: time the serial and the parallel save of this tp layout."""
    import numpy as np
    from mpi4py import MPI

    from hpcpar.checkpoint import load_shard, open_checkpoint
    from hpcpar.jobs.train.params import make_params
    from hpcpar.jobs.train.saver import CheckpointSaver
    from hpcpar.jobs.train.weight_holders import Holders
    from hpcpar.models.tensors import model_tensors

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    ckpt = open_checkpoint(folder / "model.h5")
    cfg = ckpt.config
    specs = model_tensors(cfg)
    shard = load_shard(ckpt, specs, rank, n, np.float32)
    params = list(make_params(cfg, specs, shard.tensors, np, rank, n).values())
    rng = np.random.default_rng(rank)

    class Adam:                         # what the saver asks of the optimizer
        state_names = ("exp_avg", "exp_avg_sq")
        states = {p.name: {"exp_avg": rng.standard_normal(p.master.shape, np.float32),
                           "exp_avg_sq": rng.random(p.master.shape, np.float32)}
                  for p in params}

        def state_dict(self):
            return self.states

    class World:                        # the bounded communicator's one call the saver uses
        def all_reduce(self, x):
            comm.Allreduce(MPI.IN_PLACE, x)

    held = [Holders(params, None, True)]
    attrs = {"step": 1, "samples": 8}
    times = {"serial": [], "parallel": [], "no fsync": []}
    fsync = os.fsync
    out = folder / f"saves-{n}"
    if rank == 0:
        out.mkdir(exist_ok=True)
    for r in range(repeats):
        for mode in times:
            saver = CheckpointSaver(comm, World(), ckpt, cfg, rank, n, lambda a: a,
                                    serial=mode == "serial")
            os.fsync = (lambda fd: None) if mode == "no fsync" else fsync
            if rank == 0:
                os.sync()                 # the last save's unsynced data, out of this one's
            comm.Barrier()
            t0 = time.perf_counter()
            saver.save(out / f"step-{r}-{mode.replace(' ', '-')}.h5", held, Adam(), attrs,
                       final=True)
            comm.Barrier()
            times[mode].append(time.perf_counter() - t0)
            saver.close()
            os.fsync = fsync
    if rank == 0:
        size = sum(f.stat().st_size for f in out.rglob("step-0-parallel*") if f.is_file())
        size += sum(f.stat().st_size for f in (out / "step-0-parallel.parts").iterdir())
        print(json.dumps({"ranks": n, "bytes": size} | {k: min(v) for k, v in times.items()}),
              flush=True)
        shutil.rmtree(out)


VARIANTS = {"end": [], "sync": ["train.save_every=1"],
            "async": ["train.save_every=1", "train.async_save=true"]}


def worker_training(folder: Path, steps: int, repeats: int) -> None:
    """Under mpiexec -n N (tp N): the training variants, interleaved, ``repeats`` runs each of
    ``run_training`` (in this process: no start-up in the time). Per run, on rank 0: the
    seconds the training loop spent in the saver's calls (saving, or snapshotting and
    waiting) and in the steps (metrics.jsonl), each the best of the runs."""
    from mpi4py import MPI

    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.train.engine import run_training
    from hpcpar.jobs.train.saver import CheckpointSaver
    comm = MPI.COMM_WORLD
    blocked = [0.0]

    def timed(method):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                blocked[0] += time.perf_counter() - t
        return call

    for name in ("save", "poll", "wait"):
        setattr(CheckpointSaver, name, timed(getattr(CheckpointSaver, name)))
    best: dict[str, dict] = {}
    for r in range(repeats):
        for name, sets in VARIANTS.items():
            out = folder / f"{name}-{r}"
            job = load_job(None, [f"model.checkpoint='{folder}/model.h5'",
                                  "data.dataset='synthetic'", "train.seq_len=64",
                                  "train.global_batch=16", f"train.steps={steps}",
                                  f"parallel.tp={comm.Get_size()}", "train.peak_tflops=1.0",
                                  f"output.path='{out}'", *sets])
            if comm.Get_rank() == 0:
                os.sync()                 # no earlier run's data left to write
            comm.Barrier()
            blocked[0] = 0.0
            run_training(comm, job, progress=False)
            comm.Barrier()
            if comm.Get_rank() == 0:
                lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                got = {"saving": blocked[0], "steps": sum(x["seconds"] for x in lines)}
                best[name] = {k: min(best.get(name, got)[k], v) for k, v in got.items()}
                shutil.rmtree(out)
    if comm.Get_rank() == 0:
        print(json.dumps(best), flush=True)


def run(mpiexec: str, n: int, args: list[str], env: dict) -> str:
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"mpiexec -n {n} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="training steps of the hidden-time runs")
    p.add_argument("--train-ranks", default="1,2",
                   help="ranks of the hidden-time runs (1 leaves a core to the writer)")
    p.add_argument("--train-repeats", type=int, default=3,
                   help="runs of each training variant (the best is kept)")
    p.add_argument("--json", help="also write the raw rows to this file (benchmarks/results/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-training", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_saves(Path(args.worker), args.repeats)
    if args.worker_training:
        return worker_training(Path(args.worker_training), args.steps, args.train_repeats)
    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MPIR_CVAR_ENABLE_HEAVY_YIELD="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, str(REPO))
    from hpcpar.checkpoint.presets import init_checkpoint
    with tempfile.TemporaryDirectory(dir=os.environ.get("HPCPAR_BENCH_DIR")) as tmp:
        folder = Path(tmp)
        cfg = config(args.hidden, args.layers, args.vocab)
        init_checkpoint(folder / "model.h5", cfg)
        params = (folder / "model.h5").stat().st_size // 4
        print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"{params / 1e6:.1f}M parameters; a checkpoint (weights + 2 AdamW moments, "
              f"float32) {3 * params * 4 / 1e6:.0f} MB")
        print(f"{'ranks':>5}  {'serial s':>9}  {'parallel s':>10}  {'speed-up':>8}  "
              f"{'GB/s':>5}  {'no fsync s':>10}  {'speed-up':>8}")
        rows = []
        for n in [int(r) for r in args.ranks.split(",") if r]:
            line = run(mpiexec, n, [__file__, "--worker", str(folder), "--repeats",
                                    str(args.repeats)], env).strip().splitlines()[-1]
            r = json.loads(line)
            rows.append(dict(r, kind="save"))
            print(f"{n:>5}  {r['serial']:>9.3f}  {r['parallel']:>10.3f}  "
                  f"{r['serial'] / r['parallel']:>7.2f}x  {r['bytes'] / r['parallel'] / 1e9:>5.2f}"
                  f"  {r['no fsync']:>10.3f}  {r['serial'] / r['no fsync']:>7.2f}x", flush=True)
        steps = args.steps
        saves = steps - 1                     # the last step's save is in every run
        for n in [int(r) for r in args.train_ranks.split(",") if r]:
            best = json.loads(run(mpiexec, n, [__file__, "--worker-training", str(folder),
                                               "--steps", str(steps), "--train-repeats",
                                               str(args.train_repeats)], env).strip()
                              .splitlines()[-1])
            end, sync, bg = (best[k] for k in VARIANTS)
            print(f"training, {n} rank(s) (tp {n}) of {os.cpu_count()} cores, {steps} steps, "
                  f"seconds of rank 0's loop (saving | steps): saves at the end only "
                  f"{end['saving']:.2f} | {end['steps']:.2f}; --save-every 1: "
                  f"{sync['saving']:.2f} | {sync['steps']:.2f}; and --async-save "
                  f"{bg['saving']:.2f} | {bg['steps']:.2f}")
            cost = sync["saving"] - end["saving"]
            left = bg["saving"] - end["saving"] + max(0.0, bg["steps"] - end["steps"])
            print(f"  the {saves} extra saves hold training {cost:.2f} s written at once and "
                  f"{left:.2f} s in the background (snapshots, waits, slower steps): "
                  f"{100 * (1 - left / cost) if cost > 0 else 0:.0f}% of their time hidden",
                  flush=True)
            rows.append({"kind": "training", "ranks": n, "steps": steps, "seconds": best})
        if args.json:
            Path(args.json).write_text(json.dumps({
                "machine": f"{os.cpu_count()}-core CPU, float32, one BLAS thread per rank",
                "command": "python benchmarks/checkpoint_save.py " + " ".join(sys.argv[1:]),
                "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                          "parameters": params}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
