"""Where one decoder layer's time goes on the GPU: the whole layer and each op, in prefill
and in a decode step, CPU (launch) time against GPU time (``cupyx.profiler.benchmark``).

    python benchmarks/gpu_layer.py [--dtype bfloat16] [--batch 16] [--prompt-length 512]

Random weights of the Llama-3.2-1B layer shape. A decode step whose CPU time is above its
GPU time is launch-bound: that is what CUDA graphs remove.
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-length", type=int, default=512)
    args = ap.parse_args(argv)
    import cupy as cp
    from cupyx.profiler import benchmark
    from mpi4py import MPI

    from hpcpar.parallel.device.backend import select_backend
    from hpcpar.checkpoint.presets import preset_config
    from hpcpar.parallel.comm import MpiCommunicator
    from hpcpar.models.config import ModelConfig
    from hpcpar.parallel.device.dtypes import float_dtype
    from hpcpar.models.decoder import DecoderStage
    from hpcpar.parallel.ops import AttentionRows, ops_for
    from hpcpar.models.tensors import StageSpan, stage_tensors

    dtype = float_dtype(args.dtype)
    backend = select_backend("cupy", 0, dtype)
    ops = ops_for(backend)
    cfg = ModelConfig.from_hf(preset_config("llama3-1b"))
    specs = stage_tensors(cfg, range(1), False, False)
    rng = cp.random.default_rng(0)
    weights = {s.name: (rng.standard_normal(s.shape, dtype=cp.float32) * 0.02).astype(dtype)
               for s in specs}
    stage = DecoderStage.from_tensors(cfg, specs, weights, StageSpan(range(1), False, False),
                                      MpiCommunicator(MPI.COMM_SELF), ops, dtype)
    B, P = args.batch, args.prompt_length
    cache = stage.new_cache(B, P + 128)
    layer = stage.decoder[0]
    lengths = np.full(B, P)

    def show(name, fn, n=50):
        r = benchmark(fn, n_repeat=n, n_warmup=3)
        print(f"  {name:<34} CPU {r.cpu_times.mean() * 1e3:8.3f} ms   "
              f"GPU {r.gpu_times.mean() * 1e3:8.3f} ms", flush=True)

    for phase, T, rows in (
            ("prefill", P, lambda: AttentionRows.build(cp, lengths, lengths, True)),
            ("decode", 1, lambda: AttentionRows.build(cp, np.ones(B, np.int64), lengths + 1,
                                                      False))):
        print(f"{phase}: B {B}, T {T}, {args.dtype}")
        x = (rng.standard_normal((B, T, cfg.hidden_size), dtype=cp.float32)).astype(dtype)
        r = rows()
        show("whole stage (1 layer, rope tables)", lambda: stage.forward(x, r, cache))
        show("AttentionRows.build", rows)
        positions = r.starts().astype(cp.int64)[:, None] + cp.arange(T)[None, :]
        show("rope tables", lambda: stage.rope.tables(positions))
        cos, sin = stage.rope.tables(positions)
        att = layer.attention
        show("rms_norm + residual add", lambda: ops.rms_norm.add_forward(x, x,
                                                                         layer.post_norm.data,
                                                                         1e-5))
        q, k, v = att.qkv(x)
        show("qkv GEMM", lambda: att.qkv(x))
        q = q.reshape(B, T, att.heads, att.head_dim)
        k = k.reshape(B, T, att.kv_heads, att.head_dim)
        v = v.reshape(B, T, att.kv_heads, att.head_dim)
        show("rotary q, k", lambda: ops.rotary.forward(q, k, cos, sin))
        starts = r.starts()
        show("cache write", lambda: cache.write(0, k, v, starts, r.from_start, r.max_kv))
        keys, values = cache.write(0, k, v, starts, r.from_start, r.max_kv)
        show("attention", lambda: ops.attention.forward(q, keys, values, r))
        out = ops.attention.forward(q, keys, values, r).reshape(B, T, -1)
        show("o GEMM", lambda: att.o(out))
        gate, up = layer.mlp.gate_up(x)
        show("gate/up GEMM", lambda: layer.mlp.gate_up(x))
        show("swiglu", lambda: ops.swiglu.forward(gate, up))
        a = ops.swiglu.forward(gate, up)
        show("down GEMM", lambda: layer.mlp.down(a))


if __name__ == "__main__":
    main()
