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

    python benchmarks/train.py --lora 16 --batch 8 --steps 3        # LoRA rows only
    python benchmarks/train.py --activations --batch 8 --steps 2    # sequence parallelism
    python benchmarks/train.py --zero --ranks 2,4,8 --batch 16       # ZeRO 1, 2 and 3

--activations measures each rank's peak activation bytes (report.json, what the forward
keeps for the backward) under tp 2 and tp 4, with and without --sequence-parallel (and with
--recompute full), next to what `plan` predicts for the same layout (train.memory's
formula), and the step time.

--zero times ZeRO 1, 2 and 3 over dp 2, 4 and 8 against each other and gives each rank's
weights + gradients, optimizer and ZeRO 2/3's transient bytes (report.json) next to the
plan's, then the plan alone for the Llama 3.2 1B and 3.1 8B shapes in bfloat16.

--lora R times a LoRA run (rank R, alpha 2R, every projection q..down) against full
fine-tuning of the same model on 1 rank, and against peft + torch on one thread
(get_peft_model, AdamW(fused=True) over the adapters), all from the same adapter (peft's
initialisation, saved by peft and read with --lora-from): tokens/s and the optimizer state's
bytes (hpcpar's from its checkpoint's optimizer/ group, torch's from AdamW's state); each
run timed by its fastest step after the first.
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
            "host_mb": max(report["peak_host_mb"]), "state_mb": report["state_mb"],
            "out": str(out)}


def run_torch(args, samples: np.ndarray):
    from hpcpar.jobs.runtime import cache_dir
    model = transformers_llama(cache_dir() / f"{args.preset}-seed0.h5", threads=1)
    if model is None:
        return None
    times, losses, _ = torch_adamw_steps(model, samples, args.batch, args.steps)
    timed = times[1:] or times
    tokens = args.batch * args.seq_len
    return {"tokens_per_s": tokens * len(timed) / sum(timed), "step_s": float(np.mean(timed)),
            "loss": losses, "activations_mb": float("nan"), "host_mb": float("nan")}


LORA_TARGETS = "q,k,v,o,gate,up,down"


def optimizer_bytes(run_dir: Path, steps: int) -> int:
    """The bytes of the optimizer state a run's last checkpoint holds (its optimizer/ group:
    AdamW's two moments of every trained tensor)."""
    import h5py
    total = []
    with h5py.File(run_dir / f"step-{steps}.h5", "r") as f:
        f["optimizer"].visititems(lambda _, d: total.append(d.nbytes)
                                  if isinstance(d, h5py.Dataset) else None)
    return int(sum(total))


def run_peft(args, samples: np.ndarray, adapter: Path):
    """peft + torch on one thread: the preset's weights in transformers' class, LoRA of rank
    ``args.lora`` on every projection (peft's initialisation, saved to ``adapter`` for hpcpar
    to start from), AdamW(fused=True) over the adapters as peft's users run it."""
    try:
        import peft
        import torch
    except ImportError:
        return None
    from hpcpar.jobs.runtime import cache_dir
    model = transformers_llama(cache_dir() / f"{args.preset}-seed0.h5", threads=1)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=[f"{t}_proj" for t in LORA_TARGETS.split(",")]))
    model.save_pretrained(adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    cpu: list = []
    times, losses, opt = torch_adamw_steps(model, samples, args.batch, args.steps, params,
                                           cpu)
    step_s = float(np.min(times[1:] or times))
    state = sum(t.nbytes for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return {"tokens_per_s": args.batch * args.seq_len / step_s, "step_s": step_s,
            "cpu_step_s": float(np.median(cpu[1:] or cpu)), "loss": losses,
            "optimizer_bytes": int(state), "trained": sum(p.numel() for p in params)}


def _timed_hpcpar(mpiexec, flags, args, work: Path) -> dict:
    """A 1-rank run of the LoRA section: timed by its fastest step after the first (as
    timeit: on a shared machine the others' load only slows a step), and by the CPU time of
    a step (that of the whole run less that of a 2-step run, over the steps between: what
    the others' load leaves alone), with its optimizer state's bytes."""
    import resource

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    c0 = cpu()
    run = run_hpcpar(mpiexec, 1, flags, args, work)
    c1 = cpu()
    out = Path(run.pop("out"))
    seconds = [json.loads(line)["seconds"] for line in open(out / "metrics.jsonl")][1:]
    run["step_s"] = float(np.min(seconds))
    run["tokens_per_s"] = args.batch * args.seq_len / run["step_s"]
    run["optimizer_bytes"] = optimizer_bytes(out, args.steps)
    (work / "short").mkdir(exist_ok=True)
    run_hpcpar(mpiexec, 1, flags, argparse.Namespace(**{**vars(args), "steps": 2}),
               work / "short")
    run["cpu_step_s"] = ((c1 - c0) - (cpu() - c1)) / (args.steps - 2)
    return run


def lora_rows(args, mpiexec) -> dict:
    """The LoRA section: full fine-tuning and LoRA with hpcpar on 1 rank, LoRA with peft +
    torch on one thread; printed as a table with its ratios, returned for --json."""
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.jobs.runtime import cache_dir
    from hpcpar.jobs.train.data import synthetic_samples
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "first").mkdir()
        run_hpcpar(mpiexec, 1, [], argparse.Namespace(**{**vars(args), "steps": 1}),
                   work / "first")                          # makes the preset if needed
        full = _timed_hpcpar(mpiexec, [], args, work)
        cfg = open_checkpoint(cache_dir() / f"{args.preset}-seed0.h5").config
        samples = synthetic_samples(cfg.vocab_size, args.seq_len)
        theirs = run_peft(args, samples, work / "adapter")
        if theirs is None:
            raise SystemExit("peft + torch not installed: pip install '.[test]'")
        flags = ["--lora-from", str(work / "adapter")]
        lora = _timed_hpcpar(mpiexec, flags, args, work)
    rows = {"full fine-tuning, 1 rank": full, f"LoRA r {args.lora}, 1 rank": lora,
            f"peft + torch LoRA r {args.lora} (1 thread)": theirs}
    print(f"LoRA rank {args.lora}, alpha {2 * args.lora}, on {LORA_TARGETS}; the same adapter "
          "at the start (peft's, through --lora-from)")
    tokens = args.batch * args.seq_len
    for r in rows.values():
        r["tokens_per_cpu_s"] = tokens / r["cpu_step_s"]
    print(f"{'run':<34} {'tokens/s':>9} {'tokens/CPU-s':>13} {'optimizer MB':>13} "
          f"{'loss':>24}")
    for name, r in rows.items():
        losses = " ".join(f"{x:.4f}" for x in r["loss"])
        print(f"{name:<34} {r['tokens_per_s']:>9,.0f} {r['tokens_per_cpu_s']:>13,.0f} "
              f"{r['optimizer_bytes'] / 2**20:>13.2f} {losses:>24}")
    ratios = {}
    for key in ("tokens_per_s", "tokens_per_cpu_s", "optimizer_bytes"):
        ratios[f"lora_vs_full_{key}"] = lora[key] / full[key]
        ratios[f"lora_vs_peft_{key}"] = lora[key] / theirs[key]
    ratios["same_loss_as_peft"] = bool(np.allclose(lora["loss"], theirs["loss"], rtol=1e-4))
    for other in ("full", "peft"):
        print(f"LoRA vs {'full fine-tuning' if other == 'full' else 'peft + torch'}: "
              f"{ratios[f'lora_vs_{other}_tokens_per_s']:.2f}x tokens/s (fastest step), "
              f"{ratios[f'lora_vs_{other}_tokens_per_cpu_s']:.2f}x tokens per CPU second, "
              f"{ratios[f'lora_vs_{other}_optimizer_bytes']:.4f}x optimizer bytes")
    print(f"same losses as peft: {'yes' if ratios['same_loss_as_peft'] else 'NO'}")
    return {"rows": rows, "ratios": ratios}


def activation_rows(args, mpiexec) -> dict:
    """The --activations section: tp 2 and 4 (of ``args.ranks``), without and with sequence
    parallelism, each rank's measured peak activation MB against the plan's."""
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.jobs.runtime import cache_dir
    from hpcpar.jobs.train.memory import activation_bytes
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in sorted(r for r in (2, 4) if str(r) in args.ranks.split(",")):
            for sp in (False, True):
                for recompute in ("none", "full"):
                    flags = ["--tp", str(tp), "--recompute", recompute] + (
                        ["--sequence-parallel"] if sp else [])
                    run = run_hpcpar(mpiexec, tp, flags, args, Path(tmp))
                    cfg = open_checkpoint(cache_dir() / f"{args.preset}-seed0.h5").config
                    run["planned_mb"] = activation_bytes(
                        cfg, tp, cfg.num_hidden_layers, args.batch, args.seq_len, True, True,
                        recompute == "full", sequence_parallel=sp) / 1e6
                    name = f"tp {tp}{', sequence parallel' if sp else ''}, recompute {recompute}"
                    rows[name] = {k: v for k, v in run.items() if k != "out"}
    print(f"{'run':<44} {'measured MB':>12} {'planned MB':>11} {'step s':>7} {'loss':>18}")
    for name, r in rows.items():
        losses = " ".join(f"{x:.4f}" for x in r["loss"])
        print(f"{name:<44} {r['activations_mb']:>12.2f} {r['planned_mb']:>11.2f} "
              f"{r['step_s']:>7.2f} {losses:>18}")
    return {"rows": rows}


def zero_rows(args, mpiexec) -> dict:
    """The --zero section: ZeRO 1, 2 and 3 over dp 2, 4 and 8 (of ``args.ranks``): step time
    against ZeRO-1 at the same dp, and each rank's weights + gradients and optimizer bytes
    (report.json, the most of any rank) against the plan's; then the plan alone for the
    Llama 3.2 1B and 3.1 8B shapes in bfloat16."""
    from hpcpar.checkpoint import open_checkpoint, preset_config
    from hpcpar.jobs.layout import ParallelConfig
    from hpcpar.jobs.plan import zero_transient_bytes
    from hpcpar.jobs.runtime import cache_dir
    from hpcpar.jobs.train.memory import parameter_state_bytes
    from hpcpar.models.config import ModelConfig

    def planned(cfg, dp, zero, itemsize):
        count = cfg_params(cfg)
        st = parameter_state_bytes(count, 0, dp, dp, zero, "adamw", itemsize)
        return ((st["weights"] + st["gradients"]) / 1e6, st["optimizer"] / 1e6,
                zero_transient_bytes(cfg, ParallelConfig(dp=dp), zero, itemsize) / 1e6)

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in sorted(r for r in (2, 4, 8) if str(r) in args.ranks.split(",")):
            for zero in (1, 2, 3):
                run = run_hpcpar(mpiexec, dp, ["--dp", str(dp), "--zero", str(zero)], args,
                                 Path(tmp))
                cfg = open_checkpoint(cache_dir() / f"{args.preset}-seed0.h5").config
                state = [max(rank[k] for rank in run["state_mb"]) for k in range(4)]
                run["measured_mb"] = [state[0] + state[1], state[2], state[3]]
                run["planned_mb"] = list(planned(cfg, dp, zero, 4))
                run["dp"] = dp
                rows[f"dp {dp}, zero {zero}"] = {k: v for k, v in run.items() if k != "out"}
    print(f"{'run':<16} {'step s':>7} {'vs zero 1':>9} {'weights+grads MB':>22} "
          f"{'optimizer MB':>18} {'transient MB':>18} {'loss':>16}")
    print(f"{'':<16} {'':>7} {'':>9} {'measured / planned':>22} {'measured / planned':>18} "
          f"{'measured / bound':>18}")
    for name, r in rows.items():
        base = rows[f"dp {r['dp']}, zero 1"]
        m, pl = r["measured_mb"], r["planned_mb"]
        print(f"{name:<16} {r['step_s']:>7.2f} {r['step_s'] / base['step_s']:>9.2f} "
              f"{m[0]:>10.1f} / {pl[0]:>9.1f} {m[1]:>8.1f} / {pl[1]:>7.1f} "
              f"{m[2]:>8.1f} / {pl[2]:>7.1f} {' '.join(f'{x:.4f}' for x in r['loss']):>16}")
    plans = {}
    for shape in ("llama3-1b", "llama3-8b"):
        cfg = ModelConfig.from_hf(preset_config(shape))
        for dp in (2, 4, 8):
            plans[f"{shape}, dp {dp}"] = [planned(cfg, dp, zero, 2) for zero in (1, 2, 3)]
    print("\nplan, bfloat16 compute, AdamW: GB per rank (weights + gradients, optimizer, "
          "transient)")
    for name, stages in plans.items():
        print(f"{name:<18} " + "  ".join(
            f"zero {z}: {w / 1e3:6.2f} + {o / 1e3:5.2f} + {t / 1e3:4.2f}"
            for z, (w, o, t) in enumerate(stages, start=1)))
    return {"rows": rows, "plans": plans}


def cfg_params(cfg) -> int:
    """Every parameter of the model (one rank holds them all at dp only)."""
    from hpcpar.models.tensors import model_tensors
    return sum(int(np.prod(spec.shape)) for spec in model_tensors(cfg))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--lora", type=int, metavar="R",
                   help="instead of the layouts: LoRA of rank R against full fine-tuning and "
                        "against peft + torch")
    p.add_argument("--json", metavar="FILE",
                   help="with --lora, --zero or --activations: its rows as JSON")
    p.add_argument("--zero", action="store_true",
                   help="instead of the layouts: ZeRO 1, 2 and 3 over dp 2, 4 and 8: step time "
                        "and bytes per rank, measured and planned")
    p.add_argument("--activations", action="store_true",
                   help="instead of the layouts: activation bytes under tp 2 and 4 with and "
                        "without --sequence-parallel, measured and planned")
    args = p.parse_args()
    if args.lora and args.steps < 3:
        p.error("--lora times the steps between the first and the last: give --steps 3 or more")
    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    # a section instead of the layouts: (its rows, how its runs are made)
    sections = [(args.lora, lora_rows, "one thread"),
                (args.zero, zero_rows, "one thread per rank"),
                (args.activations, activation_rows, "one micro-batch, one thread per rank")]
    for chosen, rows_of, how in sections:
        if chosen:
            print(f"preset {args.preset}, {args.batch} x {args.seq_len} tokens per step, "
                  f"float32, AdamW, {how}, {os.cpu_count()} cores")
            result = rows_of(args, mpiexec)
            if args.json:
                Path(args.json).write_text(json.dumps({"settings": vars(args), **result},
                                                      indent=1) + "\n")
            return
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
