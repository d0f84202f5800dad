"""hpcpar on one GPU against transformers and torch on the same GPU, against the hardware's
floors, and its device memory against ``hpcpar plan``'s.

    python benchmarks/gpu.py                         # 1B shape, bf16, B 16, prompts 512, +128
    python benchmarks/gpu.py --models 8b --train 8b --cuda-graphs --out 8b.json
    python benchmarks/gpu.py --backend strict --models tiny --train tiny --batch 2 \\
        --prompt-length 16 --new-tokens 4 --train-batch 2 --train-seq-len 32 \\
        --train-steps 3 --cuda-graphs --fused-optimizer --out /tmp/gpu.json   # the CPU check

Workloads (random weights of the Llama-3.2-1B / Llama-3.1-8B shapes, bfloat16):
- generation: prefill and decode tokens/s of hpcpar (one rank, CuPy), of transformers eager
  (sdpa; prefill as ``model(ids, logits_to_keep=1)``, decode as ``generate()`` minus that
  prefill) and of transformers with its static cache and torch.compile (as its users run it
  at its best; the first, compiling call is not timed);
- decode with ``--cuda-graphs``: each decode step a replayed CUDA graph, a row of its own
  beside the eager decode;
- training (``--train``, 1B only by default): tokens/s of training steps (8 x 1024 tokens,
  bf16 compute; the first two steps, compiling and allocating, not timed) of hpcpar against
  torch doing the same work as its users run it: LlamaForCausalLM under bf16 autocast, sdpa
  attention, ``AdamW(fused=True)``, the same micro-batches, recompute as transformers'
  gradient checkpointing. The recipe is the first of ``RECIPES`` whose ``hpcpar plan --train``
  total fits in 90% of the device's free memory (``--device-memory-gb``: another capacity):
  full AdamW over float32 masters in 2 micro-batches (the 1B's: 47.5 GB); full AdamW,
  ``--recompute full``, micro-batches of one row (8B: 145.6 GB, more than an H200's 90%);
  LoRA (``--lora-rank`` 16, alpha 32, every projection, the base frozen in bf16) in 2
  micro-batches (8B: 98.6 GB), against peft + torch on the same bf16 base (float32 adapters,
  autocast); LoRA with recompute, one row a micro-batch. The run prints which recipe ran and
  why; ``--fused-optimizer`` adds a row of the full recipes with the optimizer step as one
  kernel;
- memory: each generation's and each training run's peak of device bytes against the plan's
  peak per rank for the same settings (``jobs.plan.plan_stages`` and ``train_plan_bytes``,
  what ``hpcpar plan`` prints), and measured / planned. On CuPy the peak is that of the
  pool's used bytes (live arrays, in CuPy's 512-byte blocks), read by a memory hook at every
  allocation, over the generation's untimed first run and the whole training run (about a
  microsecond an allocation); beside it the most the pool held (used + cached free blocks).
  The report's ``device_mb`` is neither: the pool's ``total_bytes()`` as the run ends (free
  blocks included; loading's peak not, the pool being trimmed after the model is built);
- floors from probes run here: prefill at the measured bf16 GEMM rate over 2 N FLOPs per
  token (N = matrix parameters), training over 6 N (LoRA: 4 N, no weight gradients of the
  base), decode at the measured copy bandwidth reading every weight once per step of B tokens.

hpcpar runs twice per generation (the first fills CuPy's kernel cache and builds cuDNN's
graphs, as any long job does once); its figures are the second run's report. Results go to
``--out`` (default benchmarks/results/<gpu>-<date>.json), rewritten after every figure so that
a run cut short keeps what it measured, and are printed as tables.

``--backend strict`` is the CPU check of this script, every step of the GPU run on the CPU:
hpcpar on the strict pretend device with the GPU's ops and control flow
(``HPCPAR_OPS=device``), transformers and torch on the CPU (transformers compiles its static
cache on CUDA only), NumPy's float32 GEMM and copy as the probes, the device budget's peak of
live strict arrays as the measured memory, the host's available memory (or
``--device-memory-gb``) as the capacity. Its figures are no benchmark; they show that the
script runs through, and the memory ratios that the plan and the code agree.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcpar.jobs.plan import _size          # (bytes as hpcpar plan prints them)

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"1b": "llama3-1b", "8b": "llama3-8b", "tiny": "tiny"}
HEADROOM = 0.9             # a training recipe's planned peak at most this share of the device
LORA_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def probes(xp, dtype, n: int, floats: int, sync) -> dict:
    """GEMM TFLOP/s (n^3 in ``dtype``) and copy bandwidth (``floats`` float32s read and
    written) on the array module ``xp``; ``sync`` waits for its queued work."""
    a = xp.ones((n, n), dtype=dtype)
    for _ in range(2):
        a @ a
    sync()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ a
    sync()
    tflops = 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12
    src = xp.zeros(floats, dtype=xp.float32)
    dst = xp.empty_like(src)
    dst[...] = src
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        dst[...] = src
    sync()
    bandwidth = 2 * src.nbytes * reps / (time.perf_counter() - start)
    return {"gemm_tflops": tflops, "copy_bytes_per_s": bandwidth}


class Gpu:
    """The GPU run: hpcpar on CuPy, torch on CUDA. Every device-specific call of the script
    is a method here or of ``StrictCpu``, its CPU stand-in."""
    backend, torch_device, threads = "cupy", "cuda", 8
    compiles = True                   # transformers compiles its static-cache forward here

    def __init__(self):
        import cupy
        self.cp = cupy
        self.name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def torch_sync(self) -> None:
        import torch
        torch.cuda.synchronize()

    def free(self) -> None:
        """Give the pools' free blocks back (CuPy's, and torch's once imported)."""
        gc.collect()
        self.cp.get_default_memory_pool().free_all_blocks()
        if "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()

    def probes(self) -> dict:
        """bf16 GEMM (8192^3) and copy bandwidth (2 GiB, read + write)."""
        from hpcpar.parallel.device.dtypes import float_dtype
        figures = probes(self.cp, float_dtype("bfloat16"), 8192, 2 ** 30 // 2, self.sync)
        self.free()
        return figures

    @contextlib.contextmanager
    def peak(self):
        """Yields a dict whose ``used`` is, after the block, the most bytes the pool lent at
        once during it (beyond those lent before), ``held`` the most it held."""
        pool = self.cp.get_default_memory_pool()
        before = pool.used_bytes()
        seen = {"used": 0, "held": pool.total_bytes()}

        class Peak(self.cp.cuda.MemoryHook):
            name = "gpu-benchmark-peak"

            def malloc_postprocess(self, **_):
                seen["used"] = max(seen["used"], pool.used_bytes() - before)
                seen["held"] = max(seen["held"], pool.total_bytes())

        with Peak():
            yield seen


class StrictCpu:
    """The CPU check: hpcpar on the strict pretend device with the GPU's ops table and
    control flow (``HPCPAR_OPS=device``: what the plan describes), torch on the CPU."""
    backend, torch_device, threads, name = "strict", "cpu", 1, "CPU (strict backend)"
    compiles = False                  # transformers compiles its static cache on CUDA only

    def __init__(self):
        os.environ["HPCPAR_OPS"] = "device"

    def sync(self) -> None:
        pass

    torch_sync = sync

    def free(self) -> None:
        gc.collect()

    def probes(self) -> dict:
        """NumPy's float32 GEMM (512^3) and copy bandwidth (32 MB, read + write)."""
        return probes(np, np.float32, 512, 2 ** 22, self.sync)

    @contextlib.contextmanager
    def peak(self):
        """As ``Gpu.peak``: the device budget's peak of live strict arrays (``held``: None,
        no pool); ``phases``: each phase's own (load, prefill, forward, optimizer, ...)."""
        from hpcpar.parallel.device.budget import Budget
        seen = {"used": 0, "held": None}
        budget = Budget()
        try:
            with budget.counting():
                yield seen
        finally:
            seen["used"] = budget.peak
            seen["phases"] = {path: max(c.peak_bytes for c in runs)
                              for path, runs in budget.runs.items() if "layer" not in path}


def capacity(device, gigabytes: float | None) -> int:
    """The bytes a training run may take: ``gigabytes``, else what hpcpar's backend says is
    free (CuPy: the device's free memory and the pool's free blocks; strict: the host's)."""
    if gigabytes:
        return int(gigabytes * 1e9)
    from hpcpar.parallel.device.backend import select_backend
    device.free()
    return int(select_backend(device.backend).free_memory_bytes() or 0)


def matrix_params(cfg) -> tuple[int, int]:
    """(parameters in the layers' and head's matrices, all weight bytes in bf16)."""
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    embed = V * h
    total = L * per_layer + embed * (1 if cfg.tie_word_embeddings else 2)
    return L * per_layer + embed, 2 * total


def generation_job(device, checkpoint: Path, tokens: int, graphs: bool = False):
    from hpcpar.jobs.job import load_job
    return load_job(None, [
        f"model.checkpoint='{checkpoint}'", "parallel.dp=1", f"parallel.backend='{device.backend}'",
        "model.dtype='bfloat16'", f"generate.max_new_tokens={tokens}",
        "generate.stop_at_eos=false", f"generate.cuda_graphs={str(graphs).lower()}"])


def run_hpcpar(device, checkpoint: Path, prompts: np.ndarray, new_tokens: int,
               graphs: bool = False) -> dict:
    """The second run's report figures, the ``job``, and without ``graphs`` the ``peak`` of
    the first, untimed run (``device.peak``'s)."""
    from mpi4py import MPI
    from hpcpar.jobs.generate import Prompts, run_generation
    job = generation_job(device, checkpoint, new_tokens, graphs)

    def once():
        return run_generation(MPI.COMM_SELF, job, prompts=Prompts(list(prompts)),
                              progress=False)

    device.free()
    with device.peak() if not graphs else contextlib.nullcontext({}) as peak:
        once()                                            # warm-up: kernels, cuDNN graphs
    device.free()                                         # the pool figure is the timed run's
    result = once()
    attrs = result.report.attrs()
    figures = {k: float(np.max(attrs[f"report_{k}"])) for k in
               ("load_seconds", "load_gb_per_s", "weight_mb", "kv_cache_mb", "device_mb")}
    return {"prefill": float(attrs["report_prefill_tokens_per_s"]),
            "decode": float(attrs["report_decode_tokens_per_s"]),
            "tokens": result.tokens, **figures, "job": job, "peak": peak}


def generation_plan(cfg, job, batch: int, prompt_length: int, new_tokens: int) -> dict:
    """``hpcpar plan``'s prediction for the job's run (``plan_stages``: rank 0's bytes)."""
    from hpcpar.jobs.plan import plan_stages
    from hpcpar.parallel.device.dtypes import float_dtype
    s = plan_stages(cfg, job.parallel.layout(1, "gpipe"), batch, prompt_length, new_tokens,
                    float_dtype(job.model.dtype).itemsize, job.generate)[0]
    return {"weights": s.weight_bytes, "kv_cache": s.kv_cache_bytes,
            "activations": s.activation_bytes, "loading": s.loading_bytes,
            "peak": s.peak_bytes}


@dataclass(frozen=True)
class Recipe:
    """How a training step is run: all weights or LoRA adapters, with or without recompute,
    in 2 micro-batches or one row each."""
    lora: bool
    recompute: bool
    one_row: bool

    def micro_batches(self, batch: int) -> int:
        return batch if self.one_row else min(2, batch)

    def describe(self, args) -> str:
        m = self.micro_batches(args.train_batch)
        what = (f"LoRA rank {args.lora_rank} on every projection (base frozen)" if self.lora
                else "full AdamW")
        return (f"{what}, {'recompute full' if self.recompute else 'no recompute'}, {m} "
                f"micro-batch(es) of {args.train_batch // m} row(s)")


RECIPES = (Recipe(lora=False, recompute=False, one_row=False),
           Recipe(lora=False, recompute=True, one_row=True),
           Recipe(lora=True, recompute=False, one_row=False),
           Recipe(lora=True, recompute=True, one_row=True))


def training_job(device, checkpoint: Path, args, recipe: Recipe, out: Path,
                 fused: bool = False, peak_tflops: float = 0.0):
    from hpcpar.jobs.job import load_job
    sets = [f"model.checkpoint='{checkpoint}'", f"parallel.backend='{device.backend}'",
            "model.dtype='bfloat16'", "data.dataset='synthetic'",
            f"train.seq_len={args.train_seq_len}", f"train.global_batch={args.train_batch}",
            f"train.steps={args.train_steps}",
            f"parallel.micro_batches={recipe.micro_batches(args.train_batch)}",
            "train.lr=1e-5", f"output.path='{out}'", f"train.fused={str(fused).lower()}",
            f"train.recompute='{'full' if recipe.recompute else 'none'}'"]
    if recipe.lora:
        sets += [f"train.lora_rank={args.lora_rank}", f"train.lora_alpha={2 * args.lora_rank}",
                 f"train.lora_targets={list(LORA_TARGETS)}"]
    if peak_tflops:                       # for MFU: the probe's, not a probe of its own
        sets.append(f"train.peak_tflops={peak_tflops}")
    return load_job(None, sets)


def training_plan(cfg, job) -> dict:
    """``hpcpar plan --train``'s bytes for the job (``train_plan_bytes``: rank 0's row)."""
    from hpcpar.jobs.plan import train_plan_bytes
    from hpcpar.parallel.device.dtypes import float_dtype
    row = train_plan_bytes(cfg, job.parallel.layout(1, "1f1b"), job.parallel.virtual_stages,
                           job.train, bool(job.parallel.sequence_parallel),
                           float_dtype(job.model.dtype).itemsize)[0]
    return {k: v for k, v in row.items() if k != "chunks"}


def choose_recipe(device, cfg, checkpoint: Path, args, work: Path) -> tuple:
    """(the first recipe whose planned total is at most ``HEADROOM`` of the capacity, or
    None; its plan; why, one line per recipe tried; the capacity in bytes)."""
    room = capacity(device, args.device_memory_gb)
    why = []
    for recipe in RECIPES:
        plan = training_plan(cfg, training_job(device, checkpoint, args, recipe, work))
        fits = plan["total"] <= HEADROOM * room
        why.append(f"{recipe.describe(args)}: plan {_size(plan['total'])} "
                   f"{'<=' if fits else '>'} {HEADROOM:.0%} of {_size(room)}")
        if fits:
            return recipe, plan, why, room
    return None, None, why, room


def run_hpcpar_train(device, job, measure: bool = False) -> tuple[float, dict]:
    """Tokens/s of the steps after the first two (metrics.jsonl of one run), and with
    ``measure`` the run's peak (``used``, ``held``); the run's folder is removed after."""
    from mpi4py import MPI
    from hpcpar.jobs.train.engine import run_training
    out = Path(job.output.path)
    device.free()
    with device.peak() if measure else contextlib.nullcontext({}) as peak:
        run_training(MPI.COMM_SELF, job, progress=False)
    timed = [json.loads(line) for line in open(out / "metrics.jsonl")][2:]
    shutil.rmtree(out, ignore_errors=True)               # its checkpoint: GBs of a full run
    device.free()
    return sum(m["tokens"] for m in timed) / sum(m["seconds"] for m in timed), peak


def add_lora(model, rank: int):
    """peft's LoRA of every projection (rank, alpha 2 x rank, no dropout) on ``model``: the
    model to train, its trainable parameters, a function giving the model back without the
    adapters, and what made them (peft comes with the test extra and the GPU check's
    wheels)."""
    import peft
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(
        LORA_TARGETS.values()), lora_dropout=0.0, bias="none")
    wrapped = peft.get_peft_model(model, config)          # float32 adapters on a bf16 base
    return (wrapped, [p for p in wrapped.parameters() if p.requires_grad], wrapped.unload,
            f"peft {peft.__version__}")


def run_torch_train(device, checkpoint: Path, args, recipe: Recipe, model=None) -> tuple:
    """torch's best single-device recipe doing the work of ``recipe`` on the same weights:
    bf16 autocast, fused AdamW, its micro-batches, gradient checkpointing for recompute; full
    training on a float32 model of its own, LoRA on ``model`` (bf16). Returns (tokens/s,
    what ran, ``model`` without its adapters)."""
    import torch
    from baselines import transformers_llama
    from hpcpar.checkpoint import open_checkpoint
    unload = None
    if not recipe.lora:
        model = transformers_llama(checkpoint, threads=device.threads,
                                   device=device.torch_device).float()
        params, what = list(model.parameters()), "torch"
    if recipe.recompute:
        _checkpointing(model, True)
    if recipe.lora:
        model, params, unload, what = add_lora(model, args.lora_rank)
    model.train()
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    vocab = open_checkpoint(checkpoint).config.vocab_size
    ids = torch.randint(0, vocab, (args.train_batch, args.train_seq_len),
                        device=device.torch_device)
    parts = ids.chunk(recipe.micro_batches(args.train_batch))   # as hpcpar splits them

    def step():
        opt.zero_grad(set_to_none=True)
        for part in parts:
            with torch.autocast(device.torch_device, dtype=torch.bfloat16):
                loss = model(part, labels=part).loss / len(parts)
            loss.backward()
        opt.step()

    for _ in range(2):
        step()
    device.torch_sync()
    start, steps = time.perf_counter(), max(args.train_steps - 2, 1)
    for _ in range(steps):
        step()
    device.torch_sync()
    tokens_per_s = steps * ids.numel() / (time.perf_counter() - start)
    opt = params = None                 # (their memory given back below)
    if unload is not None:
        model = unload()
    if recipe.recompute:
        _checkpointing(model, False)
    model.eval()
    if not recipe.lora:
        model = None
    device.free()
    return tokens_per_s, what, model


def _checkpointing(model, on: bool) -> None:
    """transformers' gradient checkpointing (non-reentrant) on or off: its
    ``activation_checkpointing_*`` methods, ``gradient_checkpointing_*`` before they came."""
    new = hasattr(model, "activation_checkpointing_enable")
    if on and new:
        model.activation_checkpointing_enable({"use_reentrant": False})
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()


def transformers_model(device, checkpoint: Path):
    import torch
    from baselines import transformers_llama
    model = transformers_llama(checkpoint, threads=device.threads, device=device.torch_device)
    return model.to(device=device.torch_device, dtype=torch.bfloat16).eval()


def run_transformers(device, model, prompts: np.ndarray, new_tokens: int,
                     compiled: bool) -> dict:
    import torch
    ids = torch.from_numpy(prompts).to(device.torch_device)
    B, P = ids.shape
    extra = {"cache_implementation": "static"} if compiled else {}

    def generate():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0, **extra)

    def timed(fn):
        device.torch_sync()
        start = time.perf_counter()
        out = fn()
        device.torch_sync()
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


class Results:
    """The run's rows, written to ``path`` whenever one is added or filled in."""

    def __init__(self, path: Path, device, probe: dict, args):
        self.path, self.rows = path, []
        self.head = {"gpu": device.name, "backend": device.backend, "probes": probe,
                     "settings": vars(args)}
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> None:
        self.path.write_text(json.dumps({**self.head, "rows": self.rows}, indent=1,
                                        default=str))


def _attempt(label: str, fn):
    """``fn()``, or None when it fails (a baseline's failure is printed, not fatal: the
    rows measured so far and after stay)."""
    try:
        return fn()
    except Exception as e:            # (out of memory, a missing package, a compile error)
        print(f"{label} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def memory_row(workload: str, plan: dict, peak: dict, **extra) -> dict:
    """The measured peak (``peak``: ``used``, ``held``) against the plan's (generation's
    ``peak``, training's ``total``)."""
    planned = plan["total"] if "total" in plan else plan["peak"]
    return {"workload": workload, "phase": "memory-plan", "planned_bytes": planned,
            "measured_bytes": peak["used"], "pool_peak_bytes": peak["held"],
            "ratio": peak["used"] / planned, "plan": plan, **extra,
            **({"phase_peaks": peak["phases"]} if peak.get("phases") else {})}


def _more_than_two(text: str) -> int:
    steps = int(text)
    if steps < 3:
        raise argparse.ArgumentTypeError(f"{steps}: the first two steps are not timed; "
                                          "give at least 3")
    return steps


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cupy", "strict"], default="cupy",
                    help="strict: the CPU check of this script (see above)")
    ap.add_argument("--models", default="1b", help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-compiled", action="store_true", help="skip transformers + compile")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="hpcpar's decode also with --cuda-graphs (a row of its own)")
    ap.add_argument("--train", default="1b", help="models to train ('' for none)")
    ap.add_argument("--fused-optimizer", action="store_true",
                    help="hpcpar's full training also with --fused-optimizer (a row of its own)")
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq-len", type=int, default=1024)
    ap.add_argument("--train-steps", type=_more_than_two, default=6,
                    help="the first two are not timed (at least 3)")
    ap.add_argument("--lora-rank", type=int, default=16, help="of the LoRA recipes")
    ap.add_argument("--device-memory-gb", type=float, default=None,
                    help="the capacity a training recipe must fit (default: free memory)")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: temp)")
    ap.add_argument("--out", default=None,
                    help="the JSON (default: benchmarks/results/<gpu>-<date>.json)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = Gpu() if args.backend == "cupy" else StrictCpu()
    probe = device.probes()
    print(f"{device.name}: GEMM {probe['gemm_tflops']:.3g} TFLOP/s, copy "
          f"{probe['copy_bytes_per_s'] / 1e12:.3g} TB/s", flush=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device.name.lower()).strip("-")
    results = Results(Path(args.out) if args.out else
                      REPO / "benchmarks" / "results" / f"{slug}-{datetime.date.today()}.json",
                      device, probe, args)
    work = Path(args.work or tempfile.mkdtemp(prefix="hpcpar-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    recipes = []
    for name in args.models.split(","):
        bench_model(device, name, work, args, probe, results, recipes)
    _report(device, results, recipes)


def random_checkpoint(name: str, work: Path) -> Path:
    """The preset's random bfloat16 checkpoint in ``work`` (made once). Its matrices are
    slices of one pool of 16M N(0, 0.02) values, each from its own offset: drawing the 8B
    shape's 8 billion values one by one takes minutes of a lease (``init_checkpoint``), and
    speed does not depend on the values. The norms are ``init_checkpoint``'s."""
    import zlib
    from hpcpar.checkpoint import preset_config
    from hpcpar.checkpoint.presets import random_tensor
    from hpcpar.checkpoint.writer import CheckpointWriter
    from hpcpar.models.tensors import stored_tensors
    from hpcpar.parallel.device.dtypes import float_dtype
    path = work / f"{PRESETS[name]}.h5"
    if path.exists():
        return path
    start = time.perf_counter()
    hf = preset_config(PRESETS[name])
    pool = (0.02 * np.random.default_rng(0).standard_normal(1 << 24)).astype(np.float32)
    with CheckpointWriter(path, hf, float_dtype("bfloat16"), source="benchmarks/gpu.py") as w:
        for spec in stored_tensors(w.config):
            if len(spec.shape) < 2:
                w.write(spec, random_tensor(spec, 0, 0.02))
                continue
            n, at = int(np.prod(spec.shape)), zlib.crc32(spec.name.encode()) % len(pool)
            w.write(spec, np.resize(np.roll(pool, -at), n).reshape(spec.shape))
    print(f"{name}: random checkpoint in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def bench_model(device, name: str, work: Path, args, probe: dict, results: "Results",
                recipes: list) -> None:
    """One model's rows: hpcpar's generation and its memory against the plan, training
    (``train_rows``), the graphed decode, then transformers' eager and compiled runs."""
    from hpcpar.checkpoint import open_checkpoint
    path = random_checkpoint(name, work)
    cfg = open_checkpoint(path).config
    n_matrix, weight_bytes = matrix_params(cfg)
    floors = {"prefill": probe["gemm_tflops"] * 1e12 / (2 * n_matrix),
              "decode": args.batch * probe["copy_bytes_per_s"] / weight_bytes}
    workload = f"generate-{name}-bf16"
    prompts = np.random.default_rng(0).integers(
        0, cfg.vocab_size, (args.batch, args.prompt_length))
    mine = run_hpcpar(device, path, prompts, args.new_tokens)
    print(f"{name}: hpcpar prefill {mine['prefill']:,.0f} decode {mine['decode']:,.0f}; "
          f"load {mine['load_seconds']:.2f} s ({mine['load_gb_per_s']:.2f} GB/s); pool "
          f"at the end {mine['device_mb']:,.0f} MB for weights {mine['weight_mb']:,.0f} MB "
          f"+ KV cache {mine['kv_cache_mb']:,.0f} MB", flush=True)
    gen = {phase: results.add({"workload": workload, "phase": phase, "hpcpar": mine[phase],
                               "transformers": None, "transformers_compiled": None,
                               "floor": floors[phase]})
           for phase in ("prefill", "decode")}
    results.add({"workload": workload, "phase": "memory", **{
        k: mine[k] for k in ("load_seconds", "load_gb_per_s", "weight_mb", "kv_cache_mb",
                             "device_mb")}})
    planned = generation_plan(cfg, mine["job"], args.batch, args.prompt_length,
                              args.new_tokens)
    row = results.add(memory_row(workload, planned, mine["peak"]))
    print(f"{name}: generation's peak {_size(row['measured_bytes'])}, the plan's "
          f"{_size(planned['peak'])}: {row['ratio']:.3f}x", flush=True)
    model = None                              # transformers' bf16 model, once loaded
    # (training before the graphed decode: a run cut short by its limit keeps it)
    if name in args.train.split(","):
        model = train_rows(device, name, cfg, path, args, probe, n_matrix, work, results,
                           recipes)
    if args.cuda_graphs:
        graphed = run_hpcpar(device, path, prompts, args.new_tokens, graphs=True)
        same = float((graphed["tokens"] == mine["tokens"]).mean())
        print(f"{name}: hpcpar --cuda-graphs decode {graphed['decode']:,.0f} tok/s; its "
              f"tokens equal the eager run's in {same:.0%} of places", flush=True)
        gen["decode-graphs"] = results.add({
            "workload": workload, "phase": "decode-graphs", "hpcpar": graphed["decode"],
            "transformers": None, "transformers_compiled": None, "floor": floors["decode"]})
    if model is None:
        device.free()
        model = _attempt(f"{name}: transformers' model",
                         lambda: transformers_model(device, path))
    if model is not None:
        baseline_rows(device, name, model, prompts, mine["tokens"], gen, args, results)
    model = None
    device.free()


def baseline_rows(device, name: str, model, prompts, tokens, gen: dict, args,
                  results: "Results") -> None:
    """transformers' eager and static-cache (+ compile on a GPU) runs beside hpcpar's rows
    ``gen`` (a graphed decode against their decode), and how many greedy tokens agree."""
    eager = _attempt(f"{name}: transformers eager", lambda: run_transformers(
        device, model, prompts, args.new_tokens, compiled=False))
    if eager:
        print(f"{name}: transformers eager prefill {eager['prefill']:,.0f} decode "
              f"{eager['decode']:,.0f}", flush=True)
        same = float((tokens[:, :8] == eager["tokens"][:, :8]).mean())
        print(f"{name}: first 8 greedy tokens equal to transformers' in {same:.0%} of "
              "places (bf16 on both sides: near-ties flip)", flush=True)
        for phase, row in gen.items():
            row["transformers"] = eager["decode" if phase == "decode-graphs" else phase]
        results.save()
    compiled = None if args.no_compiled else _attempt(
        f"{name}: transformers compiled", lambda: run_transformers(
            device, model, prompts, args.new_tokens, compiled=True))
    if compiled:
        print(f"{name}: transformers static cache{' + compile' * device.compiles} "
              f"prefill {compiled['prefill']:,.0f} decode {compiled['decode']:,.0f}",
              flush=True)
        for phase, row in gen.items():
            row["transformers_compiled"] = compiled[
                "decode" if phase == "decode-graphs" else phase]
        results.save()


def train_rows(device, name: str, cfg, path: Path, args, probe: dict, n_matrix: int,
               work: Path, results: Results, recipes: list):
    """The training rows of model ``name``: the recipe the plan fits, hpcpar's run (and its
    peak against the plan), the fused optimizer's, torch's; returns transformers' bf16 model
    when the baseline loaded it (LoRA), else None."""
    workload = f"train-{name}-bf16"
    recipe, plan, why, room = choose_recipe(device, cfg, path, args, work / f"plan-{name}")
    recipes.append((name, recipe and recipe.describe(args), why))
    print(f"{name}: training recipe: " + (recipe.describe(args) if recipe else "none fits")
          + "".join(f"\n    {line}" for line in why), flush=True)
    if recipe is None:
        return None
    tflops = round(probe["gemm_tflops"], 6)
    job = training_job(device, path, args, recipe, work / f"train-{name}", peak_tflops=tflops)
    mine, peak = run_hpcpar_train(device, job, measure=True)
    floor = probe["gemm_tflops"] * 1e12 / ((4 if recipe.lora else 6) * n_matrix)
    row = results.add({"workload": workload, "phase": "train", "recipe": recipe.describe(args),
                       "hpcpar": mine, "torch": None, "baseline": None, "floor": floor})
    memory = results.add(memory_row(workload, plan, peak, recipe=recipe.describe(args),
                                    capacity_bytes=room, why=why))
    phases = memory.get("phase_peaks") or {}
    top = max(phases, key=phases.get) if phases else None
    print(f"{name}: training hpcpar {mine:,.0f} tok/s; peak {_size(memory['measured_bytes'])}"
          + (f" (in {top})" if top else "") + f", the plan's {_size(plan['total'])}: "
          f"{memory['ratio']:.3f}x", flush=True)
    fused_row = None
    if args.fused_optimizer and not recipe.lora:
        job = training_job(device, path, args, recipe, work / f"train-{name}-fused", fused=True,
                           peak_tflops=tflops)
        fused, fused_peak = run_hpcpar_train(device, job, measure=True)
        fused_plan = training_plan(cfg, job)              # no optimizer scratch
        fused_memory = results.add(memory_row(workload, fused_plan, fused_peak,
                                              phase="memory-plan-fused",
                                              recipe=recipe.describe(args)))
        print(f"{name}: training hpcpar --fused-optimizer {fused:,.0f} tok/s; peak "
              f"{_size(fused_memory['measured_bytes'])}, the plan's "
              f"{_size(fused_plan['total'])}: {fused_memory['ratio']:.3f}x", flush=True)
        fused_row = results.add({"workload": workload, "phase": "train-fused",
                                 "recipe": recipe.describe(args), "hpcpar": fused,
                                 "torch": None, "baseline": None, "floor": floor})
    model = None
    if recipe.lora:
        model = _attempt(f"{name}: transformers' model", lambda: transformers_model(device, path))
    if model is not None or not recipe.lora:
        done = _attempt(f"{name}: torch training", lambda: run_torch_train(
            device, path, args, recipe, model))
        if done:
            torch_tps, what, model = done
            print(f"{name}: training {what} {torch_tps:,.0f} tok/s", flush=True)
            for r in (row, fused_row):
                if r is not None:
                    r["torch"], r["baseline"] = torch_tps, what
            results.save()
        else:
            model = None
    return model


def _report(device, results: Results, recipes: list) -> None:
    def num(x, spec=",.0f"):
        return "-" if x is None else format(x, spec)

    print(f"\n{'workload':<20} {'phase':<13} {'hpcpar':>10} {'baseline':>13} "
          f"{'compiled':>10} {'floor':>10} {'vs eager':>9} {'vs compiled':>12}")
    for r in results.rows:
        if r["phase"].startswith("memory"):
            continue
        base = r.get("transformers") if "transformers" in r else r.get("torch")
        comp = r.get("transformers_compiled")
        print(f"{r['workload']:<20} {r['phase']:<13} {num(r['hpcpar']):>10} {num(base):>13} "
              f"{num(comp):>10} {num(r['floor']):>10} "
              f"{num(base and r['hpcpar'] / base, '.2f'):>9} "
              f"{num(comp and r['hpcpar'] / comp, '.2f'):>12}")
    print(f"\n{'memory, per rank':<20} {'planned MB':>11} {'measured MB':>12} {'pool MB':>9} "
          f"{'measured/plan':>14}")
    for r in results.rows:
        if r["phase"].startswith("memory-plan"):
            mb = ",.1f" if r["planned_bytes"] >= 1e8 else ".3f"
            held = r["pool_peak_bytes"]
            fused = " (fused)" if r["phase"].endswith("fused") else ""
            print(f"{r['workload'] + fused:<20} {num(r['planned_bytes'] / 1e6, mb):>11} "
                  f"{num(r['measured_bytes'] / 1e6, mb):>12} {num(held and held / 1e6, mb):>9} "
                  f"{r['ratio']:>14.3f}")
    for name, recipe, why in recipes:
        print(f"training recipe of {name}: {recipe or 'none fits the device'}"
              + "".join(f"\n    {line}" for line in why))
    print(f"\nwritten {results.path}")


if __name__ == "__main__":
    main()
