"""hpcpar on one GPU against transformers on the same GPU and against the hardware's floors.

    python benchmarks/gpu.py                         # 1B shape, bf16, B 16, prompts 512, +128
    python benchmarks/gpu.py --models 1b,8b --new-tokens 64

Workloads (random weights of the Llama-3.2-1B / Llama-3.1-8B shapes, bfloat16):
- generation: prefill and decode tokens/s of hpcpar (one rank, CuPy), of transformers eager
  (sdpa; prefill as ``model(ids, logits_to_keep=1)``, decode as ``generate()`` minus that
  prefill) and of transformers with its static cache and torch.compile (as its users run it
  at its best; the first, compiling call is not timed);
- decode with ``--cuda-graphs`` (``--cuda-graphs`` here): each decode step a replayed CUDA
  graph, a row of its own beside the eager decode;
- training (``--train``, 1B only by default; ``--fused-optimizer``: a row with the optimizer
  step as one kernel too): tokens/s of full steps (forward, backward,
  AdamW over float32 masters, bf16 compute, 8 x 1024 tokens per step in 2 micro-batches) of
  hpcpar against torch as its users run it: LlamaForCausalLM in float32 under bf16 autocast,
  sdpa attention, ``AdamW(fused=True)``; the first steps (compiling, allocating) are not timed;
- floors from probes run here: prefill at the measured bf16 GEMM rate over 2 N FLOPs per
  token (N = matrix parameters), training over 6 N, decode at the measured copy bandwidth
  reading every weight once per step of B tokens.

hpcpar runs twice per workload (the first fills CuPy's kernel cache and builds cuDNN's
graphs, as any long job does once); its figures are the second run's report. Results go to
benchmarks/results/<gpu>-<date>.json and are printed as a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"1b": "llama3-1b", "8b": "llama3-8b"}


def probes(cp) -> dict:
    """bf16 GEMM TFLOP/s (8192^3) and device copy bandwidth (2 GiB, read + write)."""
    from hpcpar.parallel.device.dtypes import float_dtype
    n = 8192
    a = cp.ones((n, n), dtype=float_dtype("bfloat16"))
    for _ in range(2):
        a @ a
    cp.cuda.Device().synchronize()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ a
    cp.cuda.Device().synchronize()
    tflops = 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12
    src = cp.empty(2 ** 30 // 2, dtype=cp.float32)       # 2 GiB moved per copy (1 + 1)
    dst = cp.empty_like(src)
    dst[...] = src
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst[...] = src
    cp.cuda.Device().synchronize()
    bandwidth = 2 * src.nbytes * reps / (time.perf_counter() - start)
    del a, src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return {"gemm_tflops": tflops, "copy_bytes_per_s": bandwidth}


def matrix_params(cfg) -> tuple[int, int]:
    """(parameters in the layers' and head's matrices, all weight bytes in bf16)."""
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    embed = V * h
    total = L * per_layer + embed * (1 if cfg.tie_word_embeddings else 2)
    return L * per_layer + embed, 2 * total


def run_hpcpar(checkpoint: Path, prompts: np.ndarray, new_tokens: int,
               graphs: bool = False) -> dict:
    from mpi4py import MPI
    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job

    def once(tokens):
        sets = [f"model.checkpoint='{checkpoint}'", "parallel.dp=1", "parallel.backend='cupy'",
                "model.dtype='bfloat16'", f"generate.max_new_tokens={tokens}",
                "generate.stop_at_eos=false", f"generate.cuda_graphs={str(graphs).lower()}"]
        return run_generation(MPI.COMM_SELF, load_job(None, sets),
                              prompts=Prompts(list(prompts)), progress=False)

    once(new_tokens)                                      # warm-up: kernels, cuDNN graphs
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()      # the pool figure is the timed run's
    result = once(new_tokens)
    attrs = result.report.attrs()
    figures = {k: float(np.max(attrs[f"report_{k}"])) for k in
               ("load_seconds", "load_gb_per_s", "weight_mb", "kv_cache_mb", "device_mb")}
    return {"prefill": float(attrs["report_prefill_tokens_per_s"]),
            "decode": float(attrs["report_decode_tokens_per_s"]),
            "tokens": result.tokens, **figures}


def run_hpcpar_train(checkpoint: Path, args, out: Path, fused: bool = False) -> float:
    """Tokens/s of the steps after the first two (metrics.jsonl of one run); ``fused``:
    with ``--fused-optimizer``."""
    from mpi4py import MPI
    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.train.engine import run_training
    sets = [f"model.checkpoint='{checkpoint}'", "parallel.backend='cupy'",
            "model.dtype='bfloat16'", "data.dataset='synthetic'",
            f"train.seq_len={args.train_seq_len}", f"train.global_batch={args.train_batch}",
            f"train.steps={args.train_steps}", "parallel.micro_batches=2", "train.lr=1e-5",
            f"output.path='{out}'", f"train.fused={str(fused).lower()}"]
    run_training(MPI.COMM_SELF, load_job(None, sets), progress=False)
    timed = [json.loads(line) for line in open(out / "metrics.jsonl")][2:]
    return sum(m["tokens"] for m in timed) / sum(m["seconds"] for m in timed)


def run_torch_train(checkpoint: Path, args) -> float:
    """torch's best single-GPU recipe on the same weights: bf16 autocast, fused AdamW."""
    import torch
    from baselines import transformers_llama
    from hpcpar.checkpoint import open_checkpoint
    model = transformers_llama(checkpoint, threads=8).to(device="cuda", dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    vocab = open_checkpoint(checkpoint).config.vocab_size
    ids = torch.randint(0, vocab, (args.train_batch, args.train_seq_len), device="cuda")
    half = args.train_batch // 2                          # 2 micro-batches, as hpcpar runs

    def step():
        opt.zero_grad(set_to_none=True)
        for part in (ids[:half], ids[half:]):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(part, labels=part).loss / 2
            loss.backward()
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), max(args.train_steps - 2, 1)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    tokens_per_s = steps * ids.numel() / (time.perf_counter() - start)
    del model, opt
    torch.cuda.empty_cache()
    return tokens_per_s


def transformers_model(checkpoint: Path):
    import torch
    from baselines import transformers_llama
    model = transformers_llama(checkpoint, threads=8)
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def run_transformers(model, prompts: np.ndarray, new_tokens: int, compiled: bool) -> dict:
    import torch
    ids = torch.from_numpy(prompts).cuda()
    B, P = ids.shape
    extra = {"cache_implementation": "static"} if compiled else {}

    def generate():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0, **extra)

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    with torch.inference_mode():
        if compiled:
            generate()                                    # compiles (not timed)
            prefill_s, _ = timed(lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=1,
                pad_token_id=0, **extra))
        else:
            model(ids, logits_to_keep=1)
            prefill_s, _ = timed(lambda: model(ids, logits_to_keep=1))
        total_s, out = timed(generate)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"prefill": B * P / prefill_s, "decode": B * (new_tokens - 1) / decode_s,
            "tokens": out[:, P:].cpu().numpy()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-compiled", action="store_true", help="skip transformers + compile")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="hpcpar's decode also with --cuda-graphs (a row of its own)")
    ap.add_argument("--train", default="1b", help="models to train ('' for none)")
    ap.add_argument("--fused-optimizer", action="store_true",
                    help="hpcpar's training also with --fused-optimizer (a row of its own)")
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq-len", type=int, default=1024)
    ap.add_argument("--train-steps", type=int, default=6, help="the first two are not timed")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: temp)")
    args = ap.parse_args(argv)
    import cupy as cp
    from hpcpar.checkpoint import init_checkpoint, open_checkpoint
    from hpcpar.parallel.device.dtypes import float_dtype

    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    probe = probes(cp)
    print(f"{gpu}: bf16 GEMM {probe['gemm_tflops']:.0f} TFLOP/s, copy "
          f"{probe['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    rows = []
    work = Path(args.work or tempfile.mkdtemp(prefix="hpcpar-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        path = work / f"{PRESETS[name]}.h5"
        if not path.exists():
            start = time.perf_counter()
            init_checkpoint(path, PRESETS[name], seed=0, dtype=float_dtype("bfloat16"))
            print(f"{name}: random checkpoint in {time.perf_counter() - start:.0f} s",
                  flush=True)
        cfg = open_checkpoint(path).config
        prompts = np.random.default_rng(0).integers(
            0, cfg.vocab_size, (args.batch, args.prompt_length))
        mine = run_hpcpar(path, prompts, args.new_tokens)
        print(f"{name}: hpcpar prefill {mine['prefill']:,.0f} decode {mine['decode']:,.0f}; "
              f"load {mine['load_seconds']:.2f} s ({mine['load_gb_per_s']:.2f} GB/s); GPU pool "
              f"{mine['device_mb']:,.0f} MB for weights {mine['weight_mb']:,.0f} MB + KV cache "
              f"{mine['kv_cache_mb']:,.0f} MB", flush=True)
        graphed = run_hpcpar(path, prompts, args.new_tokens, graphs=True) \
            if args.cuda_graphs else None
        if graphed:
            same = float((graphed["tokens"] == mine["tokens"]).mean())
            print(f"{name}: hpcpar --cuda-graphs decode {graphed['decode']:,.0f} tok/s; its "
                  f"tokens equal the eager run's in {same:.0%} of places", flush=True)
        n_matrix, weight_bytes = matrix_params(cfg)
        if name in args.train.split(","):
            cp.get_default_memory_pool().free_all_blocks()
            trained = run_hpcpar_train(path, args, work / f"train-{name}")
            cp.get_default_memory_pool().free_all_blocks()
            fused = (run_hpcpar_train(path, args, work / f"train-{name}-fused", fused=True)
                     if args.fused_optimizer else None)
            cp.get_default_memory_pool().free_all_blocks()
            torch_tps = run_torch_train(path, args)
            print(f"{name}: training hpcpar {trained:,.0f} tok/s"
                  + (f" ({fused:,.0f} with --fused-optimizer)" if fused else "")
                  + f", torch {torch_tps:,.0f}", flush=True)
            floor = probe["gemm_tflops"] * 1e12 / (6 * n_matrix)
            rows.append({"workload": f"train-{name}-bf16", "phase": "train", "hpcpar": trained,
                         "torch": torch_tps, "floor": floor})
            if fused:
                rows.append({"workload": f"train-{name}-bf16", "phase": "train-fused",
                             "hpcpar": fused, "torch": torch_tps, "floor": floor})
        cp.get_default_memory_pool().free_all_blocks()
        model = transformers_model(path)
        eager = run_transformers(model, prompts, args.new_tokens, compiled=False)
        print(f"{name}: transformers eager prefill {eager['prefill']:,.0f} decode "
              f"{eager['decode']:,.0f}", flush=True)
        compiled = (None if args.no_compiled else
                    run_transformers(model, prompts, args.new_tokens, compiled=True))
        if compiled:
            print(f"{name}: transformers compiled prefill {compiled['prefill']:,.0f} decode "
                  f"{compiled['decode']:,.0f}", flush=True)
        same = float((mine["tokens"][:, :8] == eager["tokens"][:, :8]).mean())
        print(f"{name}: first 8 greedy tokens equal to transformers' in {same:.0%} of places "
              "(bf16 on both sides: near-ties flip)", flush=True)
        del model
        import torch
        torch.cuda.empty_cache()
        floors = {"prefill": probe["gemm_tflops"] * 1e12 / (2 * n_matrix),
                  "decode": args.batch * probe["copy_bytes_per_s"] / weight_bytes}
        for phase in ("prefill", "decode"):
            rows.append({"workload": f"generate-{name}-bf16", "phase": phase,
                         "hpcpar": mine[phase], "transformers": eager[phase],
                         "transformers_compiled": compiled[phase] if compiled else None,
                         "floor": floors[phase]})
        if graphed:
            rows.append({"workload": f"generate-{name}-bf16", "phase": "decode-graphs",
                         "hpcpar": graphed["decode"], "transformers": eager["decode"],
                         "transformers_compiled": compiled["decode"] if compiled else None,
                         "floor": floors["decode"]})
        rows.append({"workload": f"generate-{name}-bf16", "phase": "memory", **{
            k: mine[k] for k in ("load_seconds", "load_gb_per_s", "weight_mb", "kv_cache_mb",
                                 "device_mb")}})
    _report(gpu, probe, rows, args)


def _report(gpu: str, probe: dict, rows: list, args) -> None:
    print(f"\n{'workload':<20} {'phase':<8} {'hpcpar':>10} {'baseline':>13} "
          f"{'compiled':>10} {'floor':>10} {'vs eager':>9} {'vs compiled':>12}")
    for r in rows:
        if r["phase"] == "memory":
            continue
        base = r.get("transformers") or r["torch"]       # training rows: torch
        comp = r.get("transformers_compiled")
        print(f"{r['workload']:<20} {r['phase']:<8} {r['hpcpar']:>10,.0f} "
              f"{base:>13,.0f} {comp or 0:>10,.0f} {r['floor']:>10,.0f} "
              f"{r['hpcpar'] / base:>9.2f} "
              f"{(r['hpcpar'] / comp) if comp else float('nan'):>12.2f}")
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    out = REPO / "benchmarks" / "results" / f"{slug}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": gpu, "probes": probe, "settings": vars(args),
                               "rows": rows}, indent=1))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
