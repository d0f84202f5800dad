"""Tokens/s of full training steps (forward, backward, AdamW) and activation memory, as
ratios against a single rank run in the same script and against PyTorch on the same weights.

    python benchmarks/train.py                      # ~100M preset, 1, 2 and 4 ranks
    python benchmarks/train.py --batch 8 --seq-len 32 --steps 3 --ranks 1,2      # quicker

Each run is 'mpiexec -n N python -m hpcpar train' with one BLAS thread per rank, float32;
with pp 2 the last stage also computes the head (for the 100m preset, as much as 4 of its 12
layers), so runs with '--stage-layers 8,4' balance the stages;
its tokens/s come from metrics.jsonl (the first step, which warms up, is left out) and its
memory from report.json. The PyTorch baseline is what its users run: LlamaForCausalLM on
the same weights and batches, loss.backward(), torch.optim.AdamW(fused=True),
torch.set_num_threads(1).
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
from pathlib import Path

import numpy as np
from baselines import torch_adamw_steps, transformers_llama

REPO = Path(__file__).resolve().parents[1]
# name -> (ranks, flags)
RUNS = {
    "1 rank": (1, []),
    "tp 2": (2, ["--tp", "2"]),
    "pp 2, 1f1b, 8 mb": (2, ["--pp", "2", "--schedule", "1f1b", "--micro-batches", "8"]),
    "pp 2, 1f1b, 8 mb, layers 8+4": (2, ["--pp", "2", "--schedule", "1f1b", "--micro-batches",
                                         "8", "--stage-layers", "8,4"]),
    "pp 2, gpipe, 8 mb": (2, ["--pp", "2", "--schedule", "gpipe", "--micro-batches", "8"]),
    "pp 2, zb-h1, 8 mb": (2, ["--pp", "2", "--schedule", "zb-h1", "--micro-batches", "8"]),
    "pp 2, zb-h1, 8 mb, layers 8+4": (2, ["--pp", "2", "--schedule", "zb-h1", "--micro-batches",
                                          "8", "--stage-layers", "8,4"]),
    "pp 2, 1f1b, 8 mb, recompute": (2, ["--pp", "2", "--schedule", "1f1b", "--micro-batches",
                                        "8", "--recompute", "full"]),
    "dp 2": (2, ["--dp", "2"]),
    "tp 4": (4, ["--tp", "4"]),
    "pp 4, 1f1b, 8 mb": (4, ["--pp", "4", "--micro-batches", "8"]),
    "dp 2 x tp 2": (4, ["--dp", "2", "--tp", "2"]),
}


def run_hpcpar(mpiexec, n, flags, args, work: Path) -> dict:
    out = work / f"run-{abs(hash((n, tuple(flags))))}"
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "hpcpar", "train", "--checkpoint",
           f"preset:{args.preset}", "--data", "synthetic", "--seq-len", str(args.seq_len),
           "--global-batch", str(args.batch), "--steps", str(args.steps), "--out", str(out),
           "--lr", "1e-4", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    report = json.loads((out / "report.json").read_text())
    timed = metrics[1:] or metrics
    return {"tokens_per_s": sum(m["tokens"] for m in timed) / sum(m["seconds"] for m in timed),
            "step_s": float(np.mean([m["seconds"] for m in timed])),
            "loss": [m["loss"] for m in metrics],
            "activations_mb": max(report["peak_activation_mb"]),
            "host_mb": max(report["peak_host_mb"])}


def run_torch(args, samples: np.ndarray):
    from hpcpar.jobs.runtime import cache_dir
    model = transformers_llama(cache_dir() / f"{args.preset}-seed0.h5", threads=1)
    if model is None:
        return None
    times, losses = torch_adamw_steps(model, samples, args.batch, args.steps)
    timed = times[1:] or times
    tokens = args.batch * args.seq_len
    return {"tokens_per_s": tokens * len(timed) / sum(timed), "step_s": float(np.mean(timed)),
            "loss": losses, "activations_mb": float("nan"), "host_mb": float("nan")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    p.add_argument("--ranks", default="1,2,4")
    args = p.parse_args()
    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    ranks = {int(r) for r in args.ranks.split(",")}
    print(f"preset {args.preset}, {args.batch} x {args.seq_len} tokens per step, float32, "
          f"AdamW, one thread per rank, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(name, run_hpcpar(mpiexec, n, flags, args, Path(tmp)))
                for name, (n, flags) in RUNS.items() if n in ranks]
        from hpcpar.checkpoint import open_checkpoint
        from hpcpar.jobs.runtime import cache_dir
        from hpcpar.jobs.train.data import synthetic_samples
        cfg = open_checkpoint(cache_dir() / f"{args.preset}-seed0.h5").config
        # the same samples hpcpar reads (L + 1 tokens: L inputs, L labels)
        torch_run = run_torch(args, synthetic_samples(cfg.vocab_size, args.seq_len))
    base = rows[0][1]
    print(f"{'run':<30} {'tokens/s':>9} {'vs 1 rank':>10} {'step s':>7} {'act. MB':>8} "
          f"{'host MB':>8} {'same loss':>10}")
    for name, r in rows + ([("torch (1 thread)", torch_run)] if torch_run else []):
        same = np.allclose(r["loss"], base["loss"], rtol=1e-4)
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{name:<30} {r['tokens_per_s']:>9,.0f} {ratio:>10.2f}"
              f" {r['step_s']:>7.2f} {r['activations_mb']:>8.1f} {r['host_mb']:>8.0f}"
              f" {'yes' if same else 'NO':>10}")
    if torch_run:
        print(f"1 rank vs torch: {base['tokens_per_s'] / torch_run['tokens_per_s']:.2f}x")
    else:
        print("torch not installed: pip install torch==2.13.0 transformers")


if __name__ == "__main__":
    main()
