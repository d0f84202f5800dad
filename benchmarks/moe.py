"""A Mixtral-shaped mixture of experts (8 experts, top-2) on this machine: prefill, decode and
training tokens/s of hpcpar on 1 rank against transformers' MixtralForCausalLM (one thread
each), and of expert parallelism (dp 2 x ep 2: each rank holds half the experts) against the
one rank, measured in the same run; the plan's expert bytes per rank and all-to-all bytes
per token.

    python benchmarks/moe.py                        # hidden 512, 4 layers, 8 x 1024 experts
    python benchmarks/moe.py --layers 2 --batch 4 --prompt-length 32 --new-tokens 8 --steps 2

hpcpar runs as 'mpiexec -n N python -m hpcpar generate / train' with one BLAS thread per
rank, float32; its figures come from the output's report and metrics.jsonl (the first
training step, which warms up, left out). transformers runs as its users run it at its best:
prefill is ``model(ids, logits_to_keep=1)`` and decode ``generate()`` minus that prefill;
training is loss.backward() and torch.optim.AdamW(fused=True). The model is built with
transformers (random, a router of unit scale so that routing is decided, not a tie),
saved and converted, so both hold the same weights.
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

import h5py
import numpy as np
from baselines import torch_adamw_steps

REPO = Path(__file__).resolve().parents[1]
RUNS = {"1 rank": (1, []), "dp 2 x ep 2": (2, ["--dp", "2", "--ep", "2"])}


def build(work: Path, args):
    import torch
    import transformers
    from hpcpar.checkpoint import convert
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=8192, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(work / "hf")
    convert(work / "hf", work / "model.h5")
    return model


def _run(mpiexec, n, command: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-m", "hpcpar", *command],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr}")


def hpcpar_generate(mpiexec, n, flags, work: Path, prompts: Path, args) -> dict:
    out = work / f"generate-{n}.h5"
    _run(mpiexec, n, ["generate", "--checkpoint", str(work / "model.h5"), "--prompts",
                      str(prompts), "--max-new-tokens", str(args.new_tokens),
                      "--ignore-eos", "--out", str(out), *flags])
    with h5py.File(out) as f:
        return {"prefill": float(f.attrs["report_prefill_tokens_per_s"]),
                "decode": float(f.attrs["report_decode_tokens_per_s"]),
                "tokens": f["tokens"][()]}


def hpcpar_train(mpiexec, n, flags, work: Path, args) -> dict:
    out = work / f"train-{n}"
    _run(mpiexec, n, ["train", "--checkpoint", str(work / "model.h5"), "--data",
                      str(work / "samples.npy"), "--global-batch", str(args.batch), "--steps",
                      str(args.steps), "--lr", "1e-4", "--weight-decay", "0", "--out", str(out),
                      *flags])
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    timed = metrics[1:] or metrics
    return {"tokens_per_s": sum(m["tokens"] for m in timed) / sum(m["seconds"] for m in timed),
            "loss": [m["loss"] for m in metrics]}


def transformers_generate(model, prompts: np.ndarray, args) -> dict:
    import torch
    ids = torch.from_numpy(prompts)
    best_prefill = best_generate = float("inf")
    with torch.inference_mode():
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            best_prefill = min(best_prefill, time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, pad_token_id=0)
            best_generate = min(best_generate, time.perf_counter() - t0)
    decode_s = max(best_generate - best_prefill, 1e-9)
    return {"prefill": prompts.size / best_prefill,
            "decode": len(prompts) * (args.new_tokens - 1) / decode_s,
            "tokens": out[:, prompts.shape[1]:].numpy()}


def torch_train(model, samples: np.ndarray, args) -> dict:
    times, losses, _ = torch_adamw_steps(model, samples, args.batch, args.steps)
    timed = times[1:] or times
    return {"tokens_per_s": args.batch * args.seq_len * len(timed) / sum(timed),
            "loss": losses}


def plan_lines(work: Path) -> list[str]:
    from hpcpar.checkpoint import open_checkpoint
    from hpcpar.jobs.layout import ParallelConfig
    from hpcpar.jobs.plan import plan_stages
    cfg = open_checkpoint(work / "model.h5").config
    out = []
    for ep in (1, 2):
        stage = plan_stages(cfg, ParallelConfig(dp=2, ep=ep), 8, 64, 16, 4)[0]
        out.append(f"ep {ep}: weights/rank {stage.weight_bytes / 1e6:.1f} MB, of which experts "
                   f"{stage.expert_bytes / 1e6:.1f} MB; all-to-all "
                   f"{stage.all_to_all_bytes_per_token / 1e3:.1f} kB per token")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64, help="training: tokens per sample")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="transformers runs (best is kept)")
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build(work, args)
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, 8192, (args.batch, args.prompt_length))
        (work / "prompts.jsonl").write_text(
            "".join(json.dumps({"ids": row.tolist()}) + "\n" for row in prompts))
        samples = rng.integers(0, 8192, (args.batch * args.steps, args.seq_len + 1))
        np.save(work / "samples.npy", samples)
        gen = {name: hpcpar_generate(mpiexec, n, flags, work, work / "prompts.jsonl", args)
               for name, (n, flags) in RUNS.items()}
        train = {name: hpcpar_train(mpiexec, n, flags, work, args)
                 for name, (n, flags) in RUNS.items()}
        hf_gen = transformers_generate(model, prompts, args)
        hf_train = torch_train(model, samples, args)
        plan = plan_lines(work)
    print(f"Mixtral shape: hidden {args.hidden}, {args.layers} layers, 8 experts of "
          f"{2 * args.hidden} (top-2), vocab 8192; batch {args.batch} x {args.prompt_length} "
          f"prompt tokens, {args.new_tokens} new; training {args.batch} x {args.seq_len} tokens, "
          f"AdamW; float32, one thread per rank, {os.cpu_count()} cores")
    base, hf_row = gen["1 rank"], {"transformers (1 thread)": hf_gen}
    print(f"{'generation':<26} {'prefill tok/s':>13} {'vs 1 rank':>9} {'vs HF':>6} "
          f"{'decode tok/s':>12} {'vs 1 rank':>9} {'vs HF':>6} {'same tokens':>11}")
    for name, r in {**gen, **hf_row}.items():
        same = "yes" if np.array_equal(r["tokens"], hf_gen["tokens"]) else "NO"
        print(f"{name:<26} {r['prefill']:>13,.0f} {r['prefill'] / base['prefill']:>9.2f} "
              f"{r['prefill'] / hf_gen['prefill']:>6.2f} {r['decode']:>12,.1f} "
              f"{r['decode'] / base['decode']:>9.2f} {r['decode'] / hf_gen['decode']:>6.2f} "
              f"{same:>11}")
    print(f"{'training':<26} {'tokens/s':>13} {'vs 1 rank':>9} {'vs torch':>8} first loss")
    for name, r in {**train, "torch (1 thread)": hf_train}.items():
        print(f"{name:<26} {r['tokens_per_s']:>13,.0f} "
              f"{r['tokens_per_s'] / train['1 rank']['tokens_per_s']:>9.2f} "
              f"{r['tokens_per_s'] / hf_train['tokens_per_s']:>8.2f} {r['loss'][0]:.5f}")
    print("plan (dp 2):", "; ".join(plan))


if __name__ == "__main__":
    main()
