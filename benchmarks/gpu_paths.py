"""What has run on a GPU: each GPU path of hpcpar, what shows that it runs there (tests by
node id, benchmark rows, check steps), and the table the README and docs/gpu.md show, written
from the recorded runs in ``benchmarks/results/`` (``gpu-check-*.json`` from
``benchmarks/gpu_check.py``, the GPU benchmark's ``<gpu>-<date>*.json``), never by hand.

    python benchmarks/gpu_paths.py            # print the table
    python benchmarks/gpu_paths.py --write    # put it into README.md between its markers
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BEGIN = "<!-- what has run on a GPU: python benchmarks/gpu_paths.py --write -->"
END = "<!-- end of what has run on a GPU -->"
OPS_GPU = "tests/test_ops_gpu.py::"


@dataclass(frozen=True)
class GpuPath:
    """One path through hpcpar on a GPU and its evidence: it has run when, in one recorded
    run, each test prefix matched a passed test and none failed, each benchmark row
    ``(workload, phase)`` was recorded, and each named check step passed. Runs before
    ``since`` (a date) do not count: the path changed after them."""
    name: str
    tests: tuple[str, ...] = ()
    rows: tuple[tuple[str, str], ...] = ()
    steps: tuple[str, ...] = ()
    since: str = ""


PATHS = (
    GpuPath("the kernels: RMSNorm, rotary, SwiGLU, cuDNN attention (prefill, decode, "
            "training)", tests=tuple(OPS_GPU + t for t in (
                "test_rms_norm", "test_rotary", "test_swiglu", "test_fused_attention"))),
    GpuPath("generation on CuPy equal to NumPy's (float32, float16, bfloat16)",
            tests=(OPS_GPU + "test_generation_on_the_gpu",)),
    GpuPath("loading each matrix straight into the products' [out, in] layout",
            tests=(OPS_GPU + "test_generation_on_the_gpu",), since="2026-11-28"),
    GpuPath("prefill and decode against transformers (1B, bf16)",
            rows=(("generate-1b-bf16", "prefill"), ("generate-1b-bf16", "decode"))),
    GpuPath("CUDA-graph decode (`--cuda-graphs`)",
            tests=(OPS_GPU + "test_graphed_decode",),
            rows=(("generate-1b-bf16", "decode-graphs"),)),
    GpuPath("a training step against torch (1B, bf16)", rows=(("train-1b-bf16", "train"),)),
    GpuPath("the optimizer over flat buffers; `--fused-optimizer`",
            tests=(OPS_GPU + "test_the_fused_optimizer", OPS_GPU + "test_training_with_the_fused"),
            rows=(("train-1b-bf16", "train-fused"), ("train-1b-bf16", "memory-plan-fused"))),
    GpuPath("the pool's peak against `hpcpar plan` (generation and training)",
            rows=(("generate-1b-bf16", "memory-plan"), ("train-1b-bf16", "memory-plan"))),
    GpuPath("the 8B shape: generation and a training step on one GPU",
            rows=(("generate-8b-bf16", "prefill"), ("generate-8b-bf16", "decode"),
                  ("train-8b-bf16", "train"))),
    GpuPath("the model families' own pieces (Qwen3's per-head norms, Gemma's GeGLU, the "
            "sliding window) against transformers",
            tests=("tests/test_hf_parity.py", "tests/test_families_2026.py")),
    GpuPath("the MoE layer on CuPy arrays",
            tests=("tests/test_moe.py::test_the_moe_layer_on_cupy",)),
    GpuPath("MoE jobs: training, scoring and generation under ep",
            tests=("tests/test_moe.py::test_a_training_step_with_the_load_balancing",
                   "tests/test_moe.py::test_training_under_expert_parallelism",
                   "tests/test_moe.py::test_scoring_under_expert_parallelism",
                   "tests/test_moe.py::test_replicas_of_very_unequal_work")),
    GpuPath("the library (`hpcpar.parallel`) on CuPy arrays, one rank and over MPI",
            tests=("tests/test_parallel.py::test_the_core_on_cupy_arrays",
                   "tests/test_parallel_mpi.py")),
    GpuPath("ring attention and a decode step over a cache split over cp",
            tests=("tests/test_context_parallel.py::test_ring_attention",
                   "tests/test_context_parallel.py::test_a_decode_step_over_a_cache_split")),
    GpuPath("the paged KV cache and prefix caching (`HPCPAR_PAGED_DEVICE=1`)",
            tests=("tests/test_prefix_cache.py::test_the_paged_cache_on_the_gpu",
                   "tests/test_paged_kv.py"), steps=("prefix",)),
    GpuPath("ZeRO 2 and 3", tests=("tests/test_train_mpi.py::test_every_zero_stage",)),
    GpuPath("sequence parallelism (`--sequence-parallel`)",
            tests=("tests/test_sequence_parallel.py::test_sequence_parallel_layouts",)),
    GpuPath("packed rows: cuDNN's ragged attention, packed training steps",
            tests=("tests/test_packing_attention.py", "tests/test_packing.py")),
    GpuPath("LoRA fine-tuning against peft", tests=("tests/test_lora.py",)),
    GpuPath("latent attention (DeepSeek) through cuDNN's rescaled scores",
            tests=(OPS_GPU + "test_latent_attention",)),
)


@dataclass(frozen=True)
class Run:
    """One recorded run on a GPU: the outcome of each test (node id -> passed, failed,
    skipped), each check step's status, and the benchmark rows recorded."""
    date: str
    gpu: str
    tests: dict
    steps: dict
    rows: frozenset


def recorded_runs(results: Path = RESULTS) -> list[Run]:
    """Every run on a GPU in ``results``, oldest first: a check's JSON, and the benchmark's
    JSON files of the same GPU and day folded into it (a benchmark alone is a run too)."""
    runs: dict[tuple[str, str], dict] = {}
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        if "gpu" not in record:
            continue
        date = record.get("date") or re.search(r"\d{4}-\d{2}-\d{2}", path.name)[0]
        run = runs.setdefault((date, short_gpu(record["gpu"])),
                              {"tests": {}, "steps": {}, "rows": set()})
        for step in record.get("steps", []):
            run["steps"][step["name"]] = step["status"]
            run["tests"].update(step.get("tests", {}))
        run["rows"] |= {(r["workload"], r["phase"]) for r in record.get("rows", [])}
    return [Run(date, gpu, r["tests"], r["steps"], frozenset(r["rows"]))
            for (date, gpu), r in sorted(runs.items())]


def short_gpu(name: str) -> str:
    return re.sub(r"^NVIDIA ", "", name)


def verdict(path: GpuPath, run: Run) -> str | None:
    """What ``run`` shows of ``path``: 'passed (N tests)', 'failed: ...', 'partly: ...', or
    None when the run holds nothing of it (or came before the path's ``since``)."""
    if run.date < path.since:
        return None
    matched = {t: o for t, o in run.tests.items() if any(t.startswith(p) for p in path.tests)}
    steps = {s: run.steps[s] for s in path.steps if s in run.steps}
    rows = [r for r in path.rows if r in run.rows]
    if not matched and not steps and not rows:
        return None
    failed = [t.split("::", 1)[-1] for t, o in matched.items() if o == "failed"]
    failed += [f"step {s} ({status})" for s, status in steps.items() if status != "passed"]
    if failed:
        return "failed: " + ", ".join(failed[:3]) + (" ..." if len(failed) > 3 else "")
    missing = [p.split("::")[-1] for p in path.tests
               if not any(t.startswith(p) and o == "passed" for t, o in matched.items())]
    missing += [f"{w} {phase}" for w, phase in path.rows if (w, phase) not in run.rows]
    missing += [f"step {s}" for s in path.steps if s not in steps]
    if missing:
        return "partly; not run: " + ", ".join(missing)
    passed = sum(o == "passed" for o in matched.values())
    return (f"passed ({passed} test{'s' * (passed > 1)})" if passed else
            "ran (the benchmark's rows)")


def gpu_table(runs: list[Run] | None = None) -> str:
    """The table: each path, the latest recorded run that shows it, and what it showed."""
    runs = recorded_runs() if runs is None else runs
    lines = ["| GPU path | last run on a GPU | result |", "|---|---|---|"]
    for path in PATHS:
        shown = [(run, verdict(path, run)) for run in runs]
        shown = [(run, v) for run, v in shown if v is not None]
        when, result = ((f"{shown[-1][0].date}, {shown[-1][0].gpu}", shown[-1][1]) if shown
                        else ("not yet", "waits for a GPU"))
        lines.append(f"| {path.name} | {when} | {result} |")
    return "\n".join(lines)


def write_readme(readme: Path = REPO / "README.md") -> bool:
    """Replace the table between README.md's markers; True if it changed."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN!r} ... {END!r} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{gpu_table()}\n{END}{tail}"
    readme.write_text(new)
    return new != text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the table into README.md")
    args = ap.parse_args(argv)
    if args.write:
        print("README.md " + ("updated" if write_readme() else "already up to date"))
    else:
        print(gpu_table())


if __name__ == "__main__":
    main()
