"""The steps of the one call made whenever a GPU is at hand (``benchmarks/gpu_check.sh``
installs the carried wheels, then runs this): the ``-m gpu`` tests, the GPU benchmark's rows,
every device test on CuPy, the paths behind their switches, in the order of what they tell,
inside one time budget, so that a lease of a few minutes sees the most it can and a step
that fails does not stop the next.

    python3 benchmarks/gpu_check.py                       # every step, 540 s in all
    python3 benchmarks/gpu_check.py --steps benchmark-8b  # the steps named, in this order
    python3 benchmarks/gpu_check.py --list                # the steps, their limits, commands

It writes to ``$OUT`` (else ``benchmarks/results/``):
    gpu-check-<date>.log        every step's output, in order
    <gpu>-<date>-check.json     each step's status and time and each test's outcome (from
                                pytest's JUnit XML), rewritten after every step; with the
                                benchmark's JSON files, what ``benchmarks/gpu_paths.py``
                                writes the README's table of what has run on a GPU from
    <gpu>-<date>-<model>.json   the benchmark's figures (``benchmarks/gpu.py``)
A step's limit is the lesser of its own and what is left of ``--seconds`` (the runner's
start is ``GPU_CHECK_STARTED``'s epoch second when the wrapper set it: its install counts);
a step with under 20 s left is not reached, and the summary says how to run those next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST = ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs")
CUPY = {"HPCPAR_BACKEND": "cupy"}
FEWEST_SECONDS = 20


@dataclass(frozen=True)
class Step:
    """One command with its own time limit. ``{out}``, ``{day}`` and ``{gpu}`` in it are
    filled in; a pytest step (``junit``) writes its JUnit XML, per rank under ``ranks``."""
    name: str
    seconds: int
    command: tuple[str, ...]
    env: dict = field(default_factory=dict)
    ranks: int = 0             # > 0: under mpiexec -n ranks
    junit: bool = True

    def argv(self, out: Path, day: str, gpu: str) -> list[str]:
        command = [part.format(out=out, day=day, gpu=gpu) for part in self.command]
        xml = str(out / f"{self.name}-{day}")
        if not self.ranks:
            return command + ([f"--junitxml={xml}.xml"] if self.junit else [])
        # each rank its own file (pytest-mpi runs every test on every rank)
        script = 'exec "$@" --junitxml="$XML-rank${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}.xml"'
        mpiexec = os.environ.get("MPIEXEC", "mpiexec")
        return [mpiexec, "-n", str(self.ranks), "env", f"XML={xml}", "bash", "-c", script,
                "step", *command, "--with-mpi"]


def benchmark(model: str, seconds: int, *extra: str) -> Step:
    return Step(f"benchmark-{model}", seconds, (
        "python3", "benchmarks/gpu.py", "--models", model, "--train", model,
        "--new-tokens", "128", "--cuda-graphs", *extra, "--out", f"{{out}}/{{gpu}}-{{day}}-{model}.json"),
        junit=False)


STEPS = (
    Step("gpu-tests", 150, (*PYTEST, "-m", "gpu", "tests")),
    benchmark("1b", 240, "--fused-optimizer"),
    # every test that runs hpcpar's array code, on CuPy (CI runs them on the strict backend)
    Step("device-tests", 150, (*PYTEST, "-n", "8", "--dist", "loadfile", "-m",
                               "device and not mpi", "tests"), env=CUPY),
    Step("device-mpi-tests", 150, (*PYTEST, "--any-world-size", "-m", "device and mpi",
                                   "tests"), env=CUPY, ranks=2),
    # the paths behind their switches: cuDNN's ragged graphs (varlen_attention.RAGGED) and
    # packed steps; sequence parallelism's jobs; the paged cache (HPCPAR_PAGED_DEVICE)
    Step("packing", 90, (*PYTEST, "-k", "cudnn or apart", "tests/test_packing_attention.py",
                         "tests/test_packing.py"), env=CUPY),
    Step("sequence-parallel", 90, (*PYTEST, "-k", "layouts_reproduce",
                                   "tests/test_sequence_parallel.py"), env=CUPY, ranks=2),
    Step("prefix", 90, ("python3", "benchmarks/prefix.py", "--no-transformers", "--workloads",
                        "shared,choices", "--json", "{out}/prefix-gpu-{day}.json"),
         env={**CUPY, "HPCPAR_PAGED_DEVICE": "1"}, junit=False),
    benchmark("8b", 420),
)


def junit_outcomes(paths: list[Path]) -> dict[str, str]:
    """node id -> passed / failed / skipped, from pytest's JUnit XML files (failed on any
    rank is failed)."""
    outcomes: dict[str, str] = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            parts = case.get("classname", "").split(".")
            module = next((i for i, p in enumerate(parts) if p.startswith("test_")),
                          len(parts) - 1)
            node = "/".join(parts[:module + 1]) + ".py::" + "::".join(
                parts[module + 1:] + [case.get("name", "")])
            kinds = {child.tag for child in case}
            outcome = ("failed" if kinds & {"failure", "error"} else
                       "skipped" if "skipped" in kinds else "passed")
            if outcomes.get(node) != "failed":
                outcomes[node] = outcome
    return outcomes


def stop(proc: subprocess.Popen) -> None:
    """End a step's process group: an interrupt first, on which pytest still writes its
    JUnit XML of the tests that ran (mpiexec passes it to the ranks), then harder."""
    for sig, grace in ((signal.SIGINT, 15), (signal.SIGTERM, 5), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, limit: float, out: Path, day: str, gpu: str, log) -> dict:
    """Run one step under ``limit`` seconds (its whole process group ended at the limit);
    its record: status, seconds, exit code and, for pytest, each test's outcome."""
    argv = step.argv(out, day, gpu)
    log.write(f"== {step.name} (at most {limit:.0f} s): {' '.join(argv)}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **step.env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=limit)
        status = "passed" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        stop(proc)
        code, status = proc.returncode, "timed out"
    record = {"name": step.name, "status": status, "exit": code,
              "seconds": round(time.monotonic() - start, 1)}
    xml = sorted(out.glob(f"{step.name}-{day}*.xml"))
    if xml:
        record["tests"] = junit_outcomes(xml)
        counts = {k: sum(v == k for v in record["tests"].values())
                  for k in ("passed", "failed", "skipped")}
        record["counts"] = counts
    log.write(f"{step.name}: {status} (exit {code}) in {record['seconds']} s\n")
    log.flush()
    return record


def machine() -> dict:
    """The GPU's name and the versions that matter, as this machine reports them."""
    info = {"python": sys.version.split()[0]}
    for module in ("cupy", "torch", "transformers", "mpi4py", "h5py", "numpy"):
        try:
            info[module] = __import__(module).__version__
        except Exception as e:                  # a missing one is a finding, not a stop
            info[module] = f"unavailable: {type(e).__name__}: {e}"
    try:
        import cupy
        info["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:
        info["gpu"], info["gpu_error"] = "no GPU", f"{type(e).__name__}: {e}"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True)
    info["commit"] = commit.stdout.strip() or os.environ.get("GPU_CHECK_COMMIT", "unknown")
    return info


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="", help="comma-separated step names (default: all)")
    ap.add_argument("--seconds", type=float, default=float(
        os.environ.get("GPU_CHECK_TOTAL_SECONDS", 540)), help="the whole call's budget")
    ap.add_argument("--list", action="store_true", help="print the steps and exit")
    args = ap.parse_args(argv)
    by_name = {s.name: s for s in STEPS}
    chosen = [by_name.get(n) for n in args.steps.split(",")] if args.steps else list(STEPS)
    if None in chosen:
        ap.error(f"--steps: choose among {', '.join(by_name)}")
    if args.list:
        for s in chosen:
            print(f"{s.name:<18} {s.seconds:>4} s  {' '.join(s.argv(Path('$OUT'), 'DAY', 'GPU'))}")
        return 0
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))
    out = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    info = machine()
    gpu = slug(info["gpu"])
    record = {"gpu": info["gpu"], "date": day, "versions": info,
              "command": "python3 benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:]),
              "seconds": args.seconds, "steps": []}
    path = out / f"{gpu}-{day}-check.json"
    print(json.dumps(info), flush=True)
    with open(out / f"gpu-check-{day}.log", "a") as log:
        for step in chosen:
            left = args.seconds - (time.time() - started)
            if left < FEWEST_SECONDS:
                record["steps"].append({"name": step.name, "status": "not reached"})
            else:
                record["steps"].append(run_step(step, min(step.seconds, left - 5), out, day,
                                                gpu, log))
            line = record["steps"][-1]
            print(f"{line['name']:<18} {line['status']:<11} {line.get('seconds', 0):>6} s "
                  f"{line.get('counts', '')}", flush=True)
            path.write_text(json.dumps(record, indent=1))
    later = [s["name"] for s in record["steps"] if s["status"] == "not reached"]
    if later:
        print(f"not reached: run GPU_CHECK_STEPS={','.join(later)} in the next lease")
    print(f"written {path}")
    return 0 if all(s["status"] == "passed" for s in record["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
