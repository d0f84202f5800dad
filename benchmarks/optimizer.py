"""Seconds of one optimizer step on the CPU over a preset model's tensors (float32, one
thread), through the library's public API: ``hp.Parameter`` per tensor, ``hp.AdamW`` /
``hp.SGD`` over them, weight decay on matrices only.

    OMP_NUM_THREADS=1 python benchmarks/optimizer.py                   # 100m preset, AdamW
    OMP_NUM_THREADS=1 python benchmarks/optimizer.py --preset tiny --optimizer sgd

The step's gradients are fixed random numbers and the clip factor is not 1 (so the gradient
scale's pass is timed too); the fastest and the median of ``--steps`` steps after one
warm-up step (the fastest is the figure to compare on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import os
from statistics import median
from time import perf_counter

import numpy as np

import hpcpar.parallel as hp
from hpcpar.checkpoint import preset_config
from hpcpar.models.config import ModelConfig
from hpcpar.models.tensors import model_tensors


def parameters(preset: str, seed: int = 0) -> list:
    cfg = ModelConfig.from_hf(preset_config(preset), preset)
    rng = np.random.default_rng(seed)
    params = []
    for spec in model_tensors(cfg):
        w = rng.standard_normal(spec.shape, dtype=np.float32) * 0.02
        p = hp.Parameter(w, name=spec.name, decay=len(spec.shape) == 2)
        p.grad[...] = rng.standard_normal(spec.shape, dtype=np.float32) * 1e-3
        params.append(p)
    return params


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    params = parameters(args.preset)
    opt = (hp.AdamW(params, lr=1e-4, weight_decay=0.1) if args.optimizer == "adamw"
           else hp.SGD(params, lr=1e-4, momentum=0.9, weight_decay=0.1))
    seconds = []
    for step in range(args.steps + 1):
        start = perf_counter()
        opt.step(grad_scale=0.999)
        seconds.append(perf_counter() - start)
    n = sum(p.master.size for p in params)
    fastest, typical = min(seconds[1:]), median(seconds[1:])
    print(f"{args.preset}: {len(params)} tensors, {n / 1e6:.1f}M parameters, "
          f"{args.optimizer}: {fastest * 1e3:.1f} ms a step at best, {typical * 1e3:.1f} median "
          f"({n / fastest / 1e6:.0f}M parameters/s; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")


if __name__ == "__main__":
    main()
