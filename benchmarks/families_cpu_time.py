"""Prefill and decode tokens per CPU second of each family against Llama at the preset's
shape, measured in this process's CPU time (``time.process_time``), not wall time: on a
machine others share, a run's wall time is mostly their load (``generate.py --families``
saw 3-4x between runs of one family), its CPU time much less.

    python benchmarks/families_cpu_time.py --only deepseek_v2,deepseek_v3 --rounds 7

One process, one BLAS thread: each family's stage built from a random checkpoint of
``generate.py``'s family settings (FAMILY_CONFIGS), a prefill of --batch prompts of
--prompt-length tokens (the last position's logits) and --new-tokens greedy decode steps
over the contiguous KV cache, the families alternating, the best of --rounds each.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from generate import ARCHITECTURES, FAMILY_CONFIGS, latent_shape  # noqa: E402


def build(work: Path, name: str, base: dict):
    """This family's stage (every layer, one rank) at ``base``'s shape."""
    from hpcpar.checkpoint import init_checkpoint, load_shard, open_checkpoint
    from hpcpar.models.decoder import DecoderStage
    from hpcpar.models.tensors import StageSpan, stage_tensors
    from hpcpar.parallel.comm import MpiCommunicator
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.parallel.ops import ops_for
    head = base["hidden_size"] // base["num_attention_heads"]
    changes = FAMILY_CONFIGS[name]
    changes = latent_shape(base, changes) if changes.get("mla") else changes
    shape = {"head_dim": head, "num_key_value_heads": base["num_key_value_heads"],
             "query_pre_attn_scalar": head, "tie_word_embeddings": False}
    init_checkpoint(work / f"{name}.h5", dict(base, **dict(shape, **changes), model_type=name,
                                              architectures=[ARCHITECTURES[name]]))
    ckpt = open_checkpoint(work / f"{name}.h5")
    layers = range(ckpt.config.num_hidden_layers)
    specs = stage_tensors(ckpt.config, layers, True, True)
    return DecoderStage.from_tensors(ckpt.config, specs, load_shard(ckpt, specs).tensors,
                                     StageSpan(layers), MpiCommunicator(MPI.COMM_SELF),
                                     ops_for(NUMPY), np.dtype(np.float32))


def cpu_seconds(stage, ids, new_tokens: int) -> tuple[float, float]:
    """(prefill, decode) CPU seconds of greedy generation from ``ids`` (B, T)."""
    from hpcpar.parallel.ops import AttentionRows
    B, T = ids.shape
    cache = stage.new_cache(B, T + new_tokens)
    lengths = np.full(B, T)
    t0 = time.process_time()
    x = stage.forward(stage.embed(ids), AttentionRows.build(np, lengths, lengths, True), cache,
                      keep=lengths - 1)
    token = np.argmax(stage.logits(x)[:, -1], axis=-1)
    t1 = time.process_time()
    for _ in range(new_tokens):
        rows = AttentionRows.build(np, np.ones(B), lengths + 1, False)
        token = np.argmax(stage.logits(stage.forward(stage.embed(token[:, None]), rows,
                                                     cache))[:, -1], axis=-1)
        lengths = lengths + 1
    return t1 - t0, time.process_time() - t1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m")
    p.add_argument("--only", help="these families (and llama), comma-separated; default all")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from hpcpar.checkpoint import preset_config
    base = preset_config(args.preset)
    names = ["llama"] + [n for n in (args.only.split(",") if args.only else FAMILY_CONFIGS)
                         if n != "llama"]
    ids = np.random.default_rng(0).integers(0, base["vocab_size"],
                                            (args.batch, args.prompt_length))
    with tempfile.TemporaryDirectory() as tmp:
        stages = {name: build(Path(tmp), name, base) for name in names}
        best = {name: [np.inf, np.inf] for name in names}
        for _ in range(args.rounds):           # alternating: every family sees one drift
            for name, stage in stages.items():
                best[name] = list(map(min, best[name], cpu_seconds(stage, ids, args.new_tokens)))
    print(f"preset {args.preset}'s shape, batch {args.batch} x {args.prompt_length} prompt "
          f"tokens, {args.new_tokens} new tokens, float32, CPU seconds of one process, best of "
          f"{args.rounds}")
    print(f"{'family':<12} {'prefill tok/s':>13} {'vs llama':>8} {'decode tok/s':>12} "
          f"{'vs llama':>8}")
    llama = best["llama"]
    for name, (prefill, decode) in best.items():
        print(f"{name:<12} {args.batch * args.prompt_length / prefill:>13,.0f} "
              f"{llama[0] / prefill:>8.2f} {args.batch * args.new_tokens / decode:>12,.1f} "
              f"{llama[1] / decode:>8.2f}")


if __name__ == "__main__":
    main()
