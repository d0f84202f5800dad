"""Long sequences on the CPU: prefill, scoring and one training step of one sequence of 2k,
8k and 32k tokens, hpcpar on one rank and under context parallelism (cp 2, cp 4) against
transformers on the same weights with as many threads as hpcpar has ranks, and each run's
peak memory per rank against what it must hold.

    python benchmarks/long.py                                   # 2k and 8k, cp 1 and 2
    python benchmarks/long.py --tokens 2048 --cp 1,2,4 --modes prefill,score,train
    python benchmarks/long.py --tokens 32768 --modes prefill,score --layers 4   # 32k runs
    python benchmarks/long.py --tokens 2048,8192 --cp 1 --modes prefill --repeat 3

``--repeat N`` runs each side N times, alternating, and reports each one's fastest: a shared
VM's speed drifts by 10-25% over minutes, more than the differences measured here.

The model is the shape of SmolLM-135M (30 layers, hidden 576, 9 heads / 3 KV heads, vocab
49,152; random weights, float32; ``--layers`` cuts it for the longest runs). Every run is its
own process, one BLAS thread per rank: hpcpar under ``mpiexec -n cp``, transformers with
``torch.set_num_threads(cp)``, as its users run it at their best on a CPU: prefill with
``logits_to_keep=1`` and its KV cache, scoring as one forward and ``log_softmax`` over the
logits, training as forward, ``loss.backward()`` and ``AdamW(fused=True)``. Prefill is a
generation job's (one new token), its prompt and KV cache split over cp.

Memory: each process's peak resident set (``ru_maxrss``), less what the interpreter held
before the model was loaded, against the bytes the run must hold: weights, the KV cache
(prefill), the activations ``plan`` predicts for one micro-batch at the rank's positions
(training; weights, gradients and AdamW state too), or one layer's O(T) activations and the
logits (prefill: the last position's, and a long prompt's layer activations those of one
prefill chunk plus the prompt's hidden states; scoring: a block of positions, at most
256 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FLOAT = 4
# SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config.json), its context widened to 32k
SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3          # Linux: kB


# ---- the workers (one process each) ---------------------------------------------------------

def hpcpar_worker(mode: str, checkpoint: str, tokens: int, cp: int, work: Path) -> None:
    """One hpcpar run under mpiexec; rank 0 prints a JSON line."""
    from mpi4py import MPI
    from hpcpar.jobs.job import load_job
    comm = MPI.COMM_WORLD
    base = peak_mb()
    ids = np.random.default_rng(0).integers(3, SMOL["vocab_size"], tokens + 1)
    if comm.Get_rank() == 0:
        np.save(work / "rows.npy", ids[None])
    comm.Barrier()
    common = [f"model.checkpoint='{checkpoint}'", f"parallel.cp={cp}", "parallel.dp=1"]
    if mode == "prefill":
        from hpcpar.jobs.generate import Prompts, run_generation
        job = load_job(None, common + ["generate.max_new_tokens=1",
                                       "generate.stop_at_eos=false"])
        result = run_generation(comm, job, prompts=Prompts([ids[:tokens]]), progress=False)
        seconds = result.report.prefill_seconds if result else 0.0
    elif mode == "score":
        from hpcpar.jobs.score import run_scoring
        np.save(work / "rows.npy", ids[None, :tokens])
        job = load_job(None, common + [f"score.data='{work}/rows.npy'",
                                       f"output.path='{work}/scores.h5'"])
        result = run_scoring(comm, job)
        seconds = result.seconds if result else 0.0
    else:
        from hpcpar.jobs.train.engine import run_training
        job = load_job(None, common + [f"data.dataset='{work}/rows.npy'",
                                       f"output.path='{work}/train'", "train.steps=1",
                                       "train.global_batch=1", "train.lr=1e-4",
                                       "train.save_every=0", "train.peak_tflops=1.0"])
        run_training(comm, job, progress=False)
        seconds = 0.0
        if comm.Get_rank() == 0:
            seconds = json.loads((work / "train" / "metrics.jsonl").read_text()
                                 .splitlines()[-1])["seconds"]
    peaks = comm.gather(peak_mb() - base, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps({"seconds": seconds, "peak_mb": max(peaks), "base_mb": base}))


def transformers_worker(mode: str, checkpoint: str, tokens: int, threads: int) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from baselines import transformers_llama
    import torch
    base = peak_mb()
    model = transformers_llama(Path(checkpoint), threads)
    ids = torch.from_numpy(np.random.default_rng(0).integers(3, SMOL["vocab_size"],
                                                             tokens + 1)[None])
    start = time.perf_counter()
    if mode == "prefill":
        with torch.no_grad():
            model(ids[:, :tokens], use_cache=True, logits_to_keep=1)
    elif mode == "score":
        with torch.no_grad():
            logits = model(ids[:, :tokens]).logits[0, :-1]
            torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:tokens, None])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        start = time.perf_counter()
        model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        opt.step()
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_mb() - base,
                      "base_mb": base}))


# ---- what each run must hold -----------------------------------------------------------------

def needed_mb(mode: str, cfg: dict, tokens: int, cp: int) -> float:
    """Weights + KV cache + the O(T) activations of one layer (prefill, scoring), or the
    training plan's weights, gradients, AdamW state and activations (training), per rank."""
    from hpcpar.models.config import ModelConfig
    from hpcpar.jobs.layout import ParallelConfig
    from hpcpar.models.decoder import PREFILL_CHUNK
    from hpcpar.parallel.context_parallel.ring_attention import ContextShard
    from hpcpar.models.tensors import stage_tensors
    from hpcpar.jobs.train.memory import activation_bytes, state_bytes
    model = ModelConfig.from_hf(cfg)
    params = sum(int(np.prod(s.shape)) for s in stage_tensors(
        model, range(model.num_hidden_layers), True, True))
    here = ContextShard(tokens, cp, 0).max_local if cp > 1 else tokens
    if mode == "train":
        ParallelConfig(cp=cp).check(model, cp)
        state = sum(state_bytes(params, "adamw").values())
        act = activation_bytes(model, 1, model.num_hidden_layers, 1, here, True, True, False)
        return (state + act) / 1e6
    h, kv = model.hidden_size, model.num_key_value_heads * model.head_dim
    q, inter = model.num_attention_heads * model.head_dim, model.intermediate_size
    layer = here * (4 * h + 3 * q + 2 * kv + 3 * inter) * FLOAT
    if mode == "prefill" and cp == 1 and here > PREFILL_CHUNK:
        # a chunk's layer activations, and the prompt's hidden states in and out
        layer = (PREFILL_CHUNK * (4 * h + 3 * q + 2 * kv + 3 * inter) + 2 * here * h) * FLOAT
    cache = 2 * model.num_hidden_layers * here * kv * FLOAT if mode == "prefill" else 0
    logits = (1 if mode == "prefill" else here) * model.vocab_size * FLOAT
    if mode == "score":                  # the head runs a block of positions at a time
        from hpcpar.jobs.score.program import LOGITS_BLOCK_BYTES
        logits = min(logits, LOGITS_BLOCK_BYTES)
    return (params * FLOAT + cache + layer + logits) / 1e6


# ---- the driver ------------------------------------------------------------------------------

def run(cmd: list[str], env: dict, baseline: bool = False) -> dict | None:
    """The worker's JSON line. A baseline killed by a signal (the out-of-memory killer at
    long lengths) is a result, printed as such: None. Anything else that fails ends the run."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if baseline and proc.returncode < 0:
        print(f"  (transformers was killed by signal {-proc.returncode}: out of memory?)")
        return None
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best(results: list) -> dict | None:
    """The fastest of repeated runs, with the largest peak memory any of them reached (None:
    no run finished, a baseline killed for memory)."""
    done = [r for r in results if r is not None]
    if not done:
        return None
    return dict(min(done, key=lambda r: r["seconds"]),
                peak_mb=max(r["peak_mb"] for r in done))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192", help="sequence lengths")
    p.add_argument("--cp", default="1,2", help="cp sizes (ranks) for scoring and training")
    p.add_argument("--modes", default="prefill,score,train")
    p.add_argument("--layers", type=int, default=SMOL["num_hidden_layers"])
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each, alternating; the fastest of each is reported")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("worker", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:                                 # inside a run: worker KIND MODE CKPT T N
        kind, mode, checkpoint, tokens, n = args.worker[:5]
        if kind == "hpcpar":
            hpcpar_worker(mode, checkpoint, int(tokens), int(n), Path(args.worker[5]))
        else:
            transformers_worker(mode, checkpoint, int(tokens), int(n))
        return

    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    sizes = [int(t) for t in args.tokens.split(",")]
    # room for the prompt and the one token a prefill generates
    cfg = dict(SMOL, num_hidden_layers=args.layers,
               max_position_embeddings=max(SMOL["max_position_embeddings"], max(sizes) + 1))
    cps = [int(c) for c in args.cp.split(",")]
    modes = args.modes.split(",")
    me = str(Path(__file__).resolve())
    print(f"SmolLM-135M shape, {args.layers} layers, float32, one thread per rank, "
          f"{os.cpu_count()} cores")
    print(f"{'mode':<8} {'tokens':>7} {'run':<22} {'seconds':>9} {'vs transformers':>16} "
          f"{'peak MB/rank':>13} {'needed MB':>10} {'peak/needed':>12}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model.h5"
        from hpcpar.checkpoint import init_checkpoint
        init_checkpoint(checkpoint, cfg)
        for tokens in sizes:
            for mode in modes:
                for n in cps:
                    bases, gots = [], []
                    for _ in range(args.repeat):         # alternating: the two see one drift
                        if not args.no_transformers:
                            bases.append(run([sys.executable, me, "transformers", mode,
                                              str(checkpoint), str(tokens), str(n)],
                                             dict(env, OMP_NUM_THREADS=str(n)), baseline=True))
                        work = Path(tempfile.mkdtemp(dir=tmp))
                        gots.append(run([mpiexec, "-n", str(n), sys.executable, me, "hpcpar",
                                         mode, str(checkpoint), str(tokens), str(n),
                                         str(work)], env))
                    base, got = best(bases), best(gots)
                    need = needed_mb(mode, cfg, tokens, n)
                    row = {"mode": mode, "tokens": tokens, "cp": n, "hpcpar": got,
                           "transformers": base, "needed_mb": need}
                    rows.append(row)
                    ratio = (f"{base['seconds'] / got['seconds']:.2f}x" if base else "-")
                    name = f"hpcpar cp {n}" if n > 1 else "hpcpar 1 rank"
                    print(f"{mode:<8} {tokens:>7} {name:<22} {got['seconds']:>9.2f} "
                          f"{ratio:>16} {got['peak_mb']:>13.0f} {need:>10.0f} "
                          f"{got['peak_mb'] / need:>12.2f}")
                    if base:
                        print(f"{'':<8} {'':>7} {f'transformers, {n} thr.':<22} "
                              f"{base['seconds']:>9.2f} {'':>16} {base['peak_mb']:>13.0f}")
                    sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
