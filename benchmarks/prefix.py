"""Automatic prefix caching on the CPU: end-to-end tokens/s of generation for requests that
share a system prompt, and for prompts with nothing in common, hpcpar with its prefix cache
(the default), hpcpar with ``--no-prefix-cache`` and transformers' ``generate`` on the same
requests and weights; and scoring of a multiple-choice set whose continuations share their
context, with and without ``score.prefix_cache``, against transformers' forward.

    python benchmarks/prefix.py                        # 32 x (1000 + 100) tokens, +16, 4 layers
    python benchmarks/prefix.py --repeat 3 --json out.json   # as recorded in the docs
    python benchmarks/prefix.py --new-tokens 64 --no-transformers --repeat 2
    python benchmarks/prefix.py --requests 256 --new-tokens 64 --layers 30   # the target
    python benchmarks/prefix.py --ranks 2              # hpcpar dp 2, transformers 2 threads
    python benchmarks/prefix.py --workloads choices --repeat 2   # scoring: 16 x 4 choices
    python benchmarks/prefix.py --workloads lengths --requests 48   # rows in flight

The defaults finish in about 3 minutes on a 2-core CPU (``--repeat 3``: about 10). The target
setting (256 requests, a 1,000-token system prompt, 100-token questions, 64 new tokens, the
whole 30 layers) is reachable by the flags above and takes hours on such a machine: its
uncached prefill alone is 282k prompt tokens.

Workloads:
  shared     ``--requests`` chat-like requests: one ``--system``-token system prompt, then a
             ``--question``-token question of each request's own, ``--new-tokens`` new tokens
             each (greedy, EOS ignored)
  unrelated  as many prompts of random ids, of lengths within 10% of system + question,
             nothing in common: the prefix cache has nothing to serve, and cached and uncached
             must take the same time within noise
  lengths    as many prompts of random ids of 8 to 2,000 tokens (uniform), nothing in
             common, both hpcpar sides under one ``--kv-memory`` (by default what
             ``--kv-rows`` rows of 2,000 tokens and the new ones take): the contiguous cache
             holds the rows that fit at the longest row's length, the paged one the blocks
             rows hold as they are; the rows in flight at most (the run report's) and
             tokens/s, no transformers side
  choices    scoring (``python -m hpcpar score``), not generation: a multiple-choice set of
             ``--contexts`` contexts of ``--context`` random ids, each followed by 4
             continuations of 20 (rows of context + continuation, a context's 4 rows
             consecutive); every position of every row is scored

Sides, each its own process (one BLAS thread per rank):
  cached       hpcpar, continuous batching in the paged KV cache with prefix caching (the
               default), ``run_generation`` under ``mpiexec -n RANKS`` (dp RANKS)
  uncached     the same with ``--no-prefix-cache`` (the contiguous cache)
  transformers ``LlamaForCausalLM.generate`` with its KV cache on RANKS threads, in batches of
               ``--hf-batch`` requests left-padded with an attention mask (1: one by one);
               the default, 32, is its fastest way on a 2-core CPU (one by one took 1.9x as
               long, batches of 8 1.6x)
  transformers, cached system prompt (shared workload; ``--no-hf-reuse`` leaves it out):
               its documented prompt reuse: the system prompt's ``DynamicCache`` computed
               once, a copy of it (repeated to the batch) given to each ``generate`` call, which
               then computes the questions alone (the batch's rows must be of one length)

The time is generation's, loading excluded: hpcpar's run report (prefill + decode seconds),
transformers' from its first call to its last's return (the system prompt's prefill
included). Tokens/s is (prompt + new tokens) / time, and new tokens / time. ``--repeat N``
runs each side N times, alternating, and reports each one's fastest: a shared VM's speed
drifts by 10-25% over minutes. "cpu s" is each run's process CPU time over the same span
(hpcpar's rank 0, its loading taken out): it leaves out what other processes took of the
cores, and the "in CPU time" ratio with it. Every side's greedy tokens are compared with
hpcpar uncached's.

Sides of ``choices``, each its own process (one BLAS thread per rank):
  cached       hpcpar ``run_scoring`` (dp RANKS) with its shared prefix (the default): the
               common beginning of a micro-batch's rows computed once; ``shared_positions``
               is how many positions it did not compute again; it packs a context's rows
               into one micro-batch whole. ``--score-micro-batches`` (default ``--contexts``)
               is passed as ``parallel.micro_batches``; the uncached side takes more when one
               would hold over 1,024 padded tokens
  uncached     the same with ``score.prefix_cache=false``
  transformers ``LlamaForCausalLM`` forward over ``--hf-score-batch`` rows at a time (rows of
               one length: no padding), ``log_softmax`` of the logits and the targets'
               log-probs; the default, 4 (one context's rows), ties with one by one as its
               fastest here (4 contexts: 12.5 s and 12.4 s); 16 rows per forward took 1.8x as
               long (its [rows, seq, vocab] logits leave the caches)

Its time is scoring's forward passes (hpcpar's ``ScoreResult.seconds``; transformers' from
its first forward to its last log-probs). Tokens/s is tokens scored (every position but a
row's first) / time. Each side's continuation log-probs are compared with uncached's (max
abs difference).

The model is the shape of SmolLM-135M (hidden 576, 9 heads / 3 KV heads, vocab 49,152;
random weights, float32) cut to ``--layers`` layers (default 4) so that the uncached sides
finish in a minute here.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from long import SMOL  # noqa: E402  (the SmolLM-135M shape, shared with long.py)

WORKLOADS = ("shared", "unrelated")       # the default; "choices" is scoring
LENGTHS = (8, 2000)                        # the lengths workload's prompt lengths, uniform
CHOICES, CONTINUATION = 4, 20               # choices per context, tokens per continuation


def requests(workload: str, n: int, system: int, question: int, vocab: int,
             seed: int = 0) -> list[np.ndarray]:
    """The prompts of ``workload``: each side builds the same ones from the seed."""
    rng = np.random.default_rng(seed)
    if workload == "shared":
        head = rng.integers(3, vocab, system)
        return [np.concatenate([head, rng.integers(3, vocab, question)]) for _ in range(n)]
    if workload == "lengths":
        lengths = rng.integers(LENGTHS[0], LENGTHS[1] + 1, n)
    else:
        total = system + question
        lengths = rng.integers(int(0.9 * total), int(1.1 * total) + 1, n)
    return [rng.integers(3, vocab, k) for k in lengths]


def kv_memory(a, cfg: dict) -> int:
    """``lengths``: the KV memory both sides get, ``--kv-memory`` or what ``--kv-rows``
    rows of the longest prompt and its new tokens take (float32, every layer)."""
    if a.kv_memory:
        return a.kv_memory
    per_position = (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
                    * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4)
    return a.kv_rows * (LENGTHS[1] + a.new_tokens) * per_position


def choices(contexts: int, context: int, vocab: int, seed: int = 0) -> np.ndarray:
    """The multiple-choice rows (contexts * CHOICES, context + CONTINUATION): each context's
    rows consecutive; each side builds the same ones from the seed."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(contexts):
        head = rng.integers(3, vocab, context)
        rows += [np.concatenate([head, rng.integers(3, vocab, CONTINUATION)])
                 for _ in range(CHOICES)]
    return np.stack(rows)


# ---- the workers (one process each) ---------------------------------------------------------

def hpcpar_worker(workload: str, checkpoint: str, cached: bool, ranks: int, a) -> None:
    """One hpcpar run under mpiexec (dp ``ranks``); rank 0 prints a JSON line and saves the
    tokens."""
    from mpi4py import MPI
    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job
    comm = MPI.COMM_WORLD
    prompts = requests(workload, a.requests, a.system, a.question, SMOL["vocab_size"], a.seed)
    sets = [f"model.checkpoint='{checkpoint}'", f"parallel.dp={ranks}",
            f"generate.max_new_tokens={a.new_tokens}", "generate.stop_at_eos=false",
            f"generate.prefix_cache={'true' if cached else 'false'}"]
    if workload == "lengths":
        sets.append(f"generate.kv_memory={kv_memory(a, dict(SMOL, num_hidden_layers=a.layers))}")
    job = load_job(None, sets)
    cpu = time.process_time()
    result = run_generation(comm, job, prompts=Prompts(prompts), progress=False)
    cpu = time.process_time() - cpu
    if comm.Get_rank() == 0:
        r = result.report
        np.save(a.work / "tokens.npy", np.asarray(result.tokens))
        print(json.dumps({"seconds": r.prefill_seconds + r.decode_seconds,
                          "prefill_seconds": r.prefill_seconds,
                          "decode_seconds": r.decode_seconds,
                          "cpu_seconds": cpu - r.load_seconds,
                          "prompt_tokens": int(r.prompt_tokens),
                          "new_tokens": int(r.new_tokens),
                          "prefix_hit_rate": r.prefix_hit_rate,
                          "rows_in_flight": r.rows_in_flight,
                          "kv_cache_mb": max(r.kv_cache_mb),
                          "peak_host_mb": max(r.peak_host_mb)}))


def hpcpar_score_worker(checkpoint: str, cached: bool, ranks: int, a) -> None:
    """One hpcpar scoring run of the choices under mpiexec (dp ``ranks``); rank 0 prints a
    JSON line and saves the continuations' log-probs."""
    from mpi4py import MPI
    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.score import run_scoring
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        np.save(a.work / "rows.npy", choices(a.contexts, a.context, SMOL["vocab_size"], a.seed))
    comm.Barrier()
    asked = a.score_micro_batches or a.contexts
    job = load_job(None, [f"model.checkpoint='{checkpoint}'", f"parallel.dp={ranks}",
                          f"parallel.micro_batches={asked}",
                          f"score.data='{a.work / 'rows.npy'}'",
                          f"output.path='{a.work / 'scores.h5'}'",
                          f"score.prefix_cache={'true' if cached else 'false'}"])
    cpu = time.process_time()
    result = run_scoring(comm, job, progress=False)
    cpu = time.process_time() - cpu
    if comm.Get_rank() == 0:
        np.save(a.work / "tokens.npy", result.token_logprobs[:, a.context:])
        print(json.dumps({"seconds": result.seconds, "cpu_seconds": cpu - result.load_seconds,
                          "tokens_scored": int(result.tokens_scored.sum()),
                          "shared_positions": int(result.shared_positions)}))


def transformers_score_worker(checkpoint: str, threads: int, batch: int, a) -> None:
    """transformers' forward over ``batch`` rows at a time, ``log_softmax`` of the logits and
    the targets' log-probs: every position's, as hpcpar scores them."""
    from baselines import transformers_llama
    import torch
    model = transformers_llama(Path(checkpoint), threads)
    model.eval()
    ids = torch.from_numpy(choices(a.contexts, a.context, SMOL["vocab_size"], a.seed))
    out = np.full(tuple(ids.shape), np.nan, dtype=np.float32)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for at in range(0, len(ids), batch):
            rows = ids[at:at + batch]
            logits = model(rows, use_cache=False).logits[:, :-1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out[at:at + len(rows), 1:] = logprobs.gather(-1, rows[:, 1:, None])[..., 0].numpy()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    np.save(a.work / "tokens.npy", out[:, a.context:])
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu,
                      "tokens_scored": int(ids.shape[0] * (ids.shape[1] - 1))}))


def transformers_worker(workload: str, checkpoint: str, threads: int, batch: int,
                        reuse: bool, a) -> None:
    """transformers' generate on the requests in batches of ``batch`` (left padding and an
    attention mask), after the system prompt's cache when ``reuse``."""
    from baselines import transformers_llama
    import torch
    from transformers import DynamicCache
    model = transformers_llama(Path(checkpoint), threads)
    model.eval()
    prompts = requests(workload, a.requests, a.system, a.question, SMOL["vocab_size"], a.seed)
    out = np.zeros((len(prompts), a.new_tokens), dtype=np.int64)
    # the cache argument's name: ``cache`` in transformers 5.2x, ``past_key_values`` before
    key = ("cache" if "cache" in inspect.signature(model.forward).parameters
           else "past_key_values")
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        system = None
        if reuse:                           # the prompt-reuse recipe of transformers' docs
            system = DynamicCache()
            model(torch.from_numpy(prompts[0][None, :a.system]), **{key: system},
                  use_cache=True, logits_to_keep=1)
        for at in range(0, len(prompts), batch):
            rows = prompts[at:at + batch]
            width = max(len(p) for p in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)      # pad id 0, left
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, p in enumerate(rows):
                ids[j, width - len(p):] = torch.from_numpy(p)
                mask[j, width - len(p):] = 1
            extra = {}
            if system is not None:
                cache = copy.deepcopy(system)
                if len(rows) > 1:
                    cache.batch_repeat_interleave(len(rows))
                extra[key] = cache
            got = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                 pad_token_id=0, **extra)
            out[at:at + len(rows)] = got[:, width:].numpy()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    np.save(a.work / "tokens.npy", out)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu,
                      "prompt_tokens": int(sum(len(p) for p in prompts)),
                      "new_tokens": int(out.size)}))


# ---- the driver ------------------------------------------------------------------------------

def run(cmd: list[str], env: dict, work: Path) -> dict:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["tokens"] = np.load(work / "tokens.npy")
    return got


def best(results: list[dict]) -> dict:
    return min(results, key=lambda r: r["seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system", type=int, default=1000, help="system prompt tokens")
    p.add_argument("--question", type=int, default=100, help="question tokens per request")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, default=1,
                   help="hpcpar's ranks (dp), transformers' threads")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="of shared, unrelated, lengths (generation) and choices (scoring)")
    p.add_argument("--kv-rows", type=int, default=8,
                   help="lengths: the KV memory of this many rows of the longest prompt")
    p.add_argument("--kv-memory", type=int, default=0,
                   help="lengths: the KV memory in bytes (0: from --kv-rows)")
    p.add_argument("--contexts", type=int, default=16, help="choices: contexts")
    p.add_argument("--context", type=int, default=500, help="choices: tokens per context")
    p.add_argument("--score-micro-batches", type=int, default=0,
                   help="choices: hpcpar's parallel.micro_batches (0: --contexts)")
    p.add_argument("--hf-score-batch", type=int, default=4,
                   help="choices: transformers' rows per forward")
    p.add_argument("--hf-batch", type=int, default=32,
                   help="transformers' requests per generate call (1: one by one)")
    p.add_argument("--no-hf-reuse", action="store_true",
                   help="leave out transformers with the system prompt's cache reused")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each side, alternating; the fastest of each is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the settings and rows here")
    p.add_argument("worker", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:          # inside a run: KIND WORKLOAD CKPT WORK, then the kind's own
        kind, workload, checkpoint, work = args.worker[:4]
        args.work = Path(work)
        rest = [int(v) for v in args.worker[4:]]
        if workload == "choices":
            if kind == "hpcpar":
                hpcpar_score_worker(checkpoint, bool(rest[0]), rest[1], args)
            else:
                transformers_score_worker(checkpoint, rest[0], rest[1], args)
        elif kind == "hpcpar":
            hpcpar_worker(workload, checkpoint, bool(rest[0]), rest[1], args)
        else:
            transformers_worker(workload, checkpoint, rest[0], rest[1], bool(rest[2]), args)
        return

    mpiexec = (os.environ.get("MPIEXEC") or shutil.which("mpiexec")
               or os.path.join(sysconfig.get_path("scripts"), "mpiexec"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    cfg = dict(SMOL, num_hidden_layers=args.layers)
    me = str(Path(__file__).resolve())
    common = [f"--requests={args.requests}", f"--system={args.system}",
              f"--question={args.question}", f"--new-tokens={args.new_tokens}",
              f"--seed={args.seed}", f"--layers={args.layers}", f"--kv-rows={args.kv_rows}",
              f"--kv-memory={args.kv_memory}"]
    n = args.ranks
    generation = [w for w in args.workloads.split(",") if w != "choices"]
    print(f"SmolLM-135M shape, {args.layers} layers, float32, one thread per rank, "
          f"{os.cpu_count()} cores")
    if generation:
        prompts = (f"system prompt {args.system} + question {args.question} tokens"
                   if generation != ["lengths"] else
                   f"prompts of {LENGTHS[0]} to {LENGTHS[1]} tokens")
        print(f"{args.requests} requests, {prompts}, {args.new_tokens} new tokens, greedy; "
              f"hpcpar dp {n}, transformers {n} thread(s), batches of {args.hf_batch}")
        print(f"{'workload':<10} {'side':<34} {'seconds':>8} {'cpu s':>6} {'tok/s':>7} "
              f"{'new tok/s':>9} {'vs uncached':>11} {'vs transformers':>15} {'hit rate':>8} "
              f"{'same tokens':>11}")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model.h5"
        from hpcpar.checkpoint import init_checkpoint
        init_checkpoint(checkpoint, cfg)
        for workload in args.workloads.split(","):
            if workload == "choices":
                score_rows, score_ratios = score_choices(args, me, mpiexec, env, checkpoint, tmp)
                rows += score_rows
                ratios += score_ratios
                continue
            sides = {CACHED: ["hpcpar", 1, n], UNCACHED: ["hpcpar", 0, n]}
            if not args.no_transformers and workload != "lengths":
                way = "one by one" if args.hf_batch == 1 else f"batches of {args.hf_batch}"
                sides[f"transformers, {way}"] = ["transformers", n, args.hf_batch, 0]
                if workload == "shared" and not args.no_hf_reuse:
                    sides[REUSED] = ["transformers", n, args.hf_batch, 1]
            runs = {name: [] for name in sides}
            for _ in range(args.repeat):            # alternating: the sides see one drift
                for name, (kind, *rest) in sides.items():
                    work = Path(tempfile.mkdtemp(dir=tmp))
                    cmd = [me, kind, workload, str(checkpoint), str(work),
                           *map(str, rest), *common]
                    if kind == "hpcpar":
                        cmd = [mpiexec, "-n", str(n), sys.executable] + cmd
                        side_env = env
                    else:
                        cmd = [sys.executable] + cmd
                        side_env = dict(env, OMP_NUM_THREADS=str(n))
                    runs[name].append(run(cmd, side_env, work))
            got = {name: best(r) for name, r in runs.items()}
            uncached = got[UNCACHED]
            hf = next((r for name, r in got.items()
                       if name.startswith("transformers, ") and name != REUSED), None)
            for name, r in got.items():
                total = r["prompt_tokens"] + r["new_tokens"]
                r["tokens_per_s"] = total / r["seconds"]
                r["new_tokens_per_s"] = r["new_tokens"] / r["seconds"]
                r["same_tokens"] = float((r["tokens"] == uncached["tokens"]).all(axis=1).mean())
                r["all_seconds"] = [x["seconds"] for x in runs[name]]
                r["all_cpu_seconds"] = [x["cpu_seconds"] for x in runs[name]]
                vs_hf = f"{hf['seconds'] / r['seconds']:.2f}x" if hf else "-"
                hit = f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else ""
                print(f"{workload:<10} {name:<34} {r['seconds']:>8.2f} {r['cpu_seconds']:>6.1f} "
                      f"{r['tokens_per_s']:>7,.0f} {r['new_tokens_per_s']:>9,.1f} "
                      f"{uncached['seconds'] / r['seconds']:>10.2f}x {vs_hf:>15} {hit:>8} "
                      f"{r['same_tokens']:>11.0%}")
                rows.append({"workload": workload, "max_new_tokens": args.new_tokens,
                             "side": name, **{k: v for k, v in r.items() if k != "tokens"}})
            ratios.append({"workload": workload, "max_new_tokens": args.new_tokens,
                           **workload_ratios(got, hf)})
            if workload == "lengths":
                held = {name: got[name]["rows_in_flight"] for name in (CACHED, UNCACHED)}
                ratios[-1]["rows_in_flight"] = held[CACHED] / max(held[UNCACHED], 1)
                print(f"lengths    rows in flight at most under --kv-memory "
                      f"{kv_memory(args, cfg) / 1e6:.1f} MB: paged {held[CACHED]}, "
                      f"contiguous {held[UNCACHED]}")
            print(f"{workload:<10} " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}x"
                                                 for k, v in ratios[-1].items()
                                                 if isinstance(v, float)))
            sys.stdout.flush()
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        args.json.write_text(json.dumps({
            "machine": f"{os.cpu_count()}-core CPU, {memory:.0f} GB, float32, one BLAS thread "
                       "per rank",
            "command": "python benchmarks/prefix.py " + " ".join(sys.argv[1:]),
            "commit": commit(), "settings": settings, "ratios": ratios, "rows": rows},
            indent=1))


def score_choices(args, me: str, mpiexec: str, env: dict, checkpoint: Path,
                  tmp: str) -> tuple[list[dict], list[dict]]:
    """The choices workload: each scoring side ``--repeat`` times, alternating; its rows and
    ratios."""
    n = args.ranks
    asked = args.score_micro_batches or args.contexts
    print(f"choices: {args.contexts} contexts of {args.context} tokens x {CHOICES} "
          f"continuations of {CONTINUATION}, every position scored; hpcpar dp {n}, "
          f"parallel.micro_batches {asked}; transformers {n} thread(s), "
          f"{args.hf_score_batch} rows per forward")
    print(f"{'workload':<10} {'side':<34} {'seconds':>8} {'cpu s':>6} {'tok/s':>7} "
          f"{'vs uncached':>11} {'vs transformers':>15} {'shared pos':>10} {'max |diff|':>10}")
    sides = {CACHED: ["hpcpar", 1, n], UNCACHED: ["hpcpar", 0, n]}
    if not args.no_transformers:
        sides[f"transformers, {args.hf_score_batch} rows per forward"] = [
            "transformers", n, args.hf_score_batch]
    runs = {name: [] for name in sides}
    for _ in range(args.repeat):                # alternating: the sides see one drift
        for name, (kind, *rest) in sides.items():
            work = Path(tempfile.mkdtemp(dir=tmp))
            cmd = [me, kind, "choices", str(checkpoint), str(work), *map(str, rest),
                   f"--contexts={args.contexts}", f"--context={args.context}",
                   f"--score-micro-batches={args.score_micro_batches}",
                   f"--ranks={n}", f"--seed={args.seed}"]
            if kind == "hpcpar":
                cmd, side_env = [mpiexec, "-n", str(n), sys.executable] + cmd, env
            else:
                cmd, side_env = [sys.executable] + cmd, dict(env, OMP_NUM_THREADS=str(n))
            runs[name].append(run(cmd, side_env, work))
    got = {name: best(r) for name, r in runs.items()}
    uncached = got[UNCACHED]
    hf = next((r for name, r in got.items() if name.startswith("transformers, ")), None)
    rows = []
    for name, r in got.items():
        r["tokens_per_s"] = r["tokens_scored"] / r["seconds"]
        r["max_abs_diff"] = float(np.abs(r["tokens"] - uncached["tokens"]).max())
        r["all_seconds"] = [x["seconds"] for x in runs[name]]
        r["all_cpu_seconds"] = [x["cpu_seconds"] for x in runs[name]]
        vs_hf = f"{hf['seconds'] / r['seconds']:.2f}x" if hf else "-"
        shared = str(r["shared_positions"]) if "shared_positions" in r else ""
        print(f"{'choices':<10} {name:<34} {r['seconds']:>8.2f} {r['cpu_seconds']:>6.1f} "
              f"{r['tokens_per_s']:>7,.0f} {uncached['seconds'] / r['seconds']:>10.2f}x "
              f"{vs_hf:>15} {shared:>10} {r['max_abs_diff']:>10.1e}")
        rows.append({"workload": "choices", "contexts": args.contexts,
                     "context": args.context, "choices": CHOICES,
                     "continuation": CONTINUATION, "side": name,
                     **{k: v for k, v in r.items() if k != "tokens"}})
    ratios = [{"workload": "choices", **workload_ratios(got, hf)}]
    print(f"{'choices':<10} " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}x"
                                          for k, v in ratios[-1].items()
                                          if isinstance(v, float)))
    sys.stdout.flush()
    return rows, ratios


def commit() -> str | None:
    """The commit hpcpar ran from, "+changes" when its package differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "hpcpar"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


CACHED, UNCACHED = "hpcpar, prefix cache", "hpcpar, --no-prefix-cache"
REUSED = "transformers, system prompt cached"


def workload_ratios(got: dict, hf: dict | None) -> dict:
    """cached / uncached (wall, and process CPU time: the same ratio with what other
    processes took of the cores left out), cached / transformers (each way)."""
    cached, uncached = got[CACHED], got[UNCACHED]
    out = {"cached_over_uncached": uncached["seconds"] / cached["seconds"],
           "same_in_cpu_time": uncached["cpu_seconds"] / cached["cpu_seconds"]}
    if hf:
        out["cached_over_transformers"] = hf["seconds"] / cached["seconds"]
    if REUSED in got:
        out["cached_over_transformers_reusing"] = got[REUSED]["seconds"] / cached["seconds"]
    return out

if __name__ == "__main__":
    main()
