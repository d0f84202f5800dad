"""Prefill and decode tokens/s of batch generation, as ratios against a single rank run in the
same script, and against Hugging Face transformers on the same weights with as many threads
as hpcpar has ranks (at most one per core: torch with more threads than cores runs its
prefill ~20x slower here, which no torch user would do).

    python benchmarks/generate.py                        # ~100M preset, 1, 2 and 4 ranks
    python benchmarks/generate.py --batch 8 --prompt-length 32 --new-tokens 8 --ranks 1,2
    python benchmarks/generate.py --families --repeats 3   # each dense family against Llama
    python benchmarks/generate.py --families --only deepseek_v2,deepseek_v3   # and Llama

Each layout runs as 'mpiexec -n N python -m hpcpar run' (one BLAS thread per rank) and its
figures are read back from the output file's report. transformers runs as its users run it
at its best: the prefill is ``model(ids, logits_to_keep=1)`` (the last position's logits,
what ``generate`` computes), and decode is ``generate()`` minus that prefill. It runs when
transformers is installed: pip install torch==2.13.0 transformers.
"""

from __future__ import annotations

import argparse
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
from baselines import transformers_llama

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (4, 1), (2, 2)],
           8: [(1, 8), (2, 4), (4, 2)]}        # (pp, tp)


# --families: each family with the preset's shape (head_dim hidden / heads, its KV heads) and
# its own features at the values its published models use; the mixtures of experts have
# shapes of their own and are left out
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": 4096},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "gemma": {"hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"hidden_act": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "sliding_window": 4096},
    "gemma3_text": {"hidden_act": "gelu_pytorch_tanh", "sliding_window": 512},
    "olmo2": {},
    # DeepSeek's latent attention with every layer dense (its experts are a shape of their
    # own): the heads' q/k of head_dim as nope + rope (2:1, V3's 128 + 64), v of head_dim,
    # a latent of 4 x nope (V3's 512 = 4 x 128); V2-Lite's plain q_proj, V3's q latent
    "deepseek_v2": {"q_lora_rank": None, "mla": True},
    "deepseek_v3": {"q_lora_rank": 384, "mla": True},
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def latent_shape(base: dict, changes: dict) -> dict:
    """A DeepSeek family's fields at the shape of ``base`` (see FAMILY_CONFIGS)."""
    changes = {k: v for k, v in changes.items() if k != "mla"}
    head = base["hidden_size"] // base["num_attention_heads"]
    nope = 2 * head // 3
    return dict(changes, num_key_value_heads=base["num_attention_heads"],
                qk_nope_head_dim=nope, qk_rope_head_dim=head - nope, v_head_dim=head,
                kv_lora_rank=4 * nope, first_k_dense_replace=base["num_hidden_layers"],
                n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)


def run_hpcpar(mpiexec, n, pp, tp, micro_batches_per_stage, work: Path,
               job: str = "job.toml") -> dict:
    out = work / f"bench-{n}-{pp}-{tp}-{Path(job).stem}.h5"
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "hpcpar", "run", str(work / job),
           "--pp", str(pp), "--tp", str(tp), "--dp", "1",
           "--micro-batches", str(pp * micro_batches_per_stage), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    with h5py.File(out) as f:
        a = f.attrs
        return {"prefill": float(a["report_prefill_tokens_per_s"]),
                "decode": float(a["report_decode_tokens_per_s"]),
                "tokens": f["tokens"][()]}


def run_transformers(checkpoint: Path, prompts: np.ndarray, new_tokens: int, repeats: int,
                     threads: int):
    model = transformers_llama(checkpoint, threads)
    if model is None:
        return None
    import torch
    model.eval()
    ids = torch.from_numpy(prompts)
    batch, length = prompts.shape
    best_prefill = best_generate = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)             # generate's own prefill: last position
            best_prefill = min(best_prefill, time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0)
            best_generate = min(best_generate, time.perf_counter() - t0)
    decode_s = max(best_generate - best_prefill, 1e-9)
    return {"prefill": batch * length / best_prefill,
            "decode": batch * (new_tokens - 1) / decode_s,
            "tokens": out[:, length:].numpy()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per pipeline stage (decode reads every weight once per "
                        "micro-batch, so more costs memory traffic there)")
    p.add_argument("--repeats", type=int, default=2, help="transformers runs (best is kept)")
    p.add_argument("--json", type=Path, help="--families: also write the settings and rows")
    p.add_argument("--only", help="--families: these families (and llama), comma-separated")
    p.add_argument("--families", action="store_true",
                   help="instead: one rank, each dense family at the preset's shape against "
                        "Llama's, --repeats runs each, alternating (best kept)")
    args = p.parse_args()
    if args.families:
        return compare_families(args)
    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        L = args.prompt_length
        (work / "job.toml").write_text(
            f'[model]\ncheckpoint = "preset:{args.preset}"\n'
            f'[data]\nprompts = "random"\nrandom_count = {args.batch}\n'
            f'random_lengths = [{L}, {L}]\n'
            f'[generate]\nmax_new_tokens = {args.new_tokens}\nstop_at_eos = false\n')
        print(f"preset {args.preset}, batch {args.batch} x {L} prompt tokens, "
              f"{args.new_tokens} new tokens, float32, one thread per rank, "
              f"{os.cpu_count()} cores")
        counts = [int(r) for r in args.ranks.split(",")]
        rows = []
        for n in counts:
            for pp, tp in LAYOUTS[n]:
                rows.append((n, f"{n} rank(s) pp {pp} tp {tp}",
                             run_hpcpar(mpiexec, n, pp, tp, args.micro_batches, work)))
        base = rows[0][2]
        from hpcpar.jobs.runtime import cache_dir
        from hpcpar.jobs.inputs.prompts import random_prompts
        from hpcpar.checkpoint import open_checkpoint
        ckpt_path = cache_dir() / f"{args.preset}-seed0.h5"
        cfg = open_checkpoint(ckpt_path).config
        prompts = np.stack(random_prompts(args.batch, (L, L), cfg.vocab_size, 0).ids)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        hf = {n: run_transformers(ckpt_path, prompts, args.new_tokens, args.repeats,
                                  min(n, cores))
              for n in counts}
    print(f"{'run':<28} {'prefill tok/s':>13} {'vs 1 rank':>9} {'vs HF':>6} "
          f"{'decode tok/s':>12} {'vs 1 rank':>9} {'vs HF':>6} {'same tokens':>11}")
    table = [(n, name, r) for n, name, r in rows]
    table += [(n, f"transformers (vs {n} rank{'s' if n > 1 else ''})", r)
              for n, r in hf.items() if r is not None]
    for n, name, r in table:
        ref = hf.get(n)
        same = "yes" if np.array_equal(r["tokens"], base["tokens"]) else "NO"
        vs_hf_p = f"{r['prefill'] / ref['prefill']:.2f}" if ref else "-"
        vs_hf_d = f"{r['decode'] / ref['decode']:.2f}" if ref else "-"
        print(f"{name:<28} {r['prefill']:>13,.0f} {r['prefill'] / base['prefill']:>9.2f} "
              f"{vs_hf_p:>6} {r['decode']:>12,.1f} {r['decode'] / base['decode']:>9.2f} "
              f"{vs_hf_d:>6} {same:>11}")
    if not any(hf.values()):
        print("transformers not installed: pip install torch==2.13.0 transformers")


def compare_families(args) -> None:
    """Prefill and decode tokens/s of each dense family at the preset's shape on one rank,
    and each one's ratio to Llama's, measured in the same run."""
    from hpcpar.checkpoint import init_checkpoint, preset_config
    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    base = preset_config(args.preset)
    shape = {"head_dim": base["hidden_size"] // base["num_attention_heads"],
             "num_key_value_heads": base["num_key_value_heads"], "query_pre_attn_scalar":
             base["hidden_size"] // base["num_attention_heads"], "tie_word_embeddings": False}
    L = args.prompt_length
    print(f"preset {args.preset}'s shape, every dense family, batch {args.batch} x {L} prompt "
          f"tokens, {args.new_tokens} new tokens, float32, one rank, one thread, best of "
          f"{args.repeats}")
    chosen = ({"llama", *args.only.split(",")} if args.only else set(FAMILY_CONFIGS))
    families = {n: c for n, c in FAMILY_CONFIGS.items() if n in chosen}
    runs: dict[str, list[dict]] = {name: [] for name in families}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, changes in families.items():
            if changes.get("mla"):
                changes = latent_shape(base, changes)
            cfg = dict(base, **dict(shape, **changes), model_type=name,
                       architectures=[ARCHITECTURES[name]])
            init_checkpoint(work / f"{name}.h5", cfg)
            (work / f"{name}.toml").write_text(
                f'[model]\ncheckpoint = "{work / name}.h5"\n'
                f'[data]\nprompts = "random"\nrandom_count = {args.batch}\n'
                f'random_lengths = [{L}, {L}]\n'
                f'[generate]\nmax_new_tokens = {args.new_tokens}\nstop_at_eos = false\n')
        for _ in range(args.repeats):              # alternating: every family sees one drift
            for name in families:
                runs[name].append(run_hpcpar(mpiexec, 1, 1, 1, 1, work, f"{name}.toml"))
    best = {name: {k: max(r[k] for r in rs) for k in ("prefill", "decode")}
            for name, rs in runs.items()}
    llama = best["llama"]
    print(f"{'family':<12} {'prefill tok/s':>13} {'vs llama':>8} {'decode tok/s':>12} "
          f"{'vs llama':>8}")
    for name, r in best.items():
        print(f"{name:<12} {r['prefill']:>13,.0f} {r['prefill'] / llama['prefill']:>8.2f} "
              f"{r['decode']:>12,.1f} {r['decode'] / llama['decode']:>8.2f}")
    if args.json:
        import json
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        rows = [{"family": name, "prefill_tokens_per_s": r["prefill"],
                 "decode_tokens_per_s": r["decode"],
                 "prefill_vs_llama": r["prefill"] / llama["prefill"],
                 "decode_vs_llama": r["decode"] / llama["decode"],
                 "all_prefill": [x["prefill"] for x in runs[name]],
                 "all_decode": [x["decode"] for x in runs[name]]} for name, r in best.items()]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip() or None
        args.json.write_text(json.dumps({
            "machine": f"{os.cpu_count()}-core CPU, float32, one rank, one BLAS thread",
            "command": "python benchmarks/generate.py " + " ".join(sys.argv[1:]),
            "commit": commit, "settings": settings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
