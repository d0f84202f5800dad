"""``hpcpar submit``: a job file as a Slurm batch job, checked before anything is queued.

The batch script (``render``) runs ``python -m hpcpar run JOB`` with one rank per task (one
GPU each, unless the nodes have none), sets the environment that matters in one place, and
follows the time-limit pattern: Slurm sends USR1 to the batch shell ``signal_seconds`` before
the limit, the shell forwards it to the ranks, which agree to stop at a step boundary, save
and exit with status 3; the shell then requeues the job, and the next start resumes
(``--resume auto``: training continues from its checkpoint, generation keeps the waves it
finished). ``slurm/*.sbatch`` are this template rendered with its defaults
(``static_scripts``).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..parallel.errors import HpcparError

LAUNCHERS = {"pmi2": "srun --mpi=pmi2", "pmix": "srun --mpi=pmix", "mpirun": "mpirun"}
NO_LIMIT = ("UNLIMITED", "INFINITE")


def time_limit_seconds(text: str) -> int | None:
    """sbatch's ``--time`` in seconds (None: no limit): minutes, minutes:seconds,
    hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds, 0 or
    UNLIMITED. Anything else is a ``ValueError``."""
    text = text.strip()
    if text.upper() in NO_LIMIT:
        return None
    days, dash, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = rest.split(":")
    if not (days.isdigit() and all(p.isdigit() for p in parts)) or len(parts) > 3:
        raise ValueError(text)
    numbers = [int(p) for p in parts]
    if dash:                                  # days-hours[:minutes[:seconds]]
        h, m, sec = (numbers + [0, 0])[:3]
    elif len(numbers) == 3:
        h, m, sec = numbers
    else:                                     # minutes[:seconds]
        h, (m, sec) = 0, (numbers + [0])[:2]
    seconds = ((int(days) * 24 + h) * 60 + m) * 60 + sec
    return seconds or None                    # 0: Slurm's no limit


@dataclass(frozen=True)
class SlurmRequest:
    job: str                     # the job file
    training: bool
    nodes: int = 1
    ranks_per_node: int = 8
    gpus_per_node: int | None = None   # default: one per rank; 0: CPU nodes
    cpus_per_task: int | None = None   # default: Slurm's (CPU nodes: the cores / ranks)
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    signal_seconds: int = 120
    name: str = "hpcpar"
    launcher: str = "pmi2"
    sets: tuple[str, ...] = ()         # --set overrides, passed on to the run

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def gpus(self) -> int:
        return self.ranks_per_node if self.gpus_per_node is None else self.gpus_per_node

    def problems(self) -> list[str]:
        out = []
        for field in ("nodes", "ranks_per_node", "signal_seconds"):
            if getattr(self, field) < 1:
                out.append(f"{field.replace('_', '-')} must be >= 1, got {getattr(self, field)}")
        if self.gpus not in (0, self.ranks_per_node):
            out.append(f"--gpus-per-node {self.gpus}: hpcpar runs one rank per GPU, so give "
                       f"--ranks-per-node {self.gpus}, or 0 GPUs for CPU nodes")
        limit = time_limit_seconds(self.time)
        if limit is not None and self.signal_seconds >= limit:
            out.append(f"--signal-seconds {self.signal_seconds} is not less than the time limit "
                       f"--time {self.time} ({limit} s): the stop would be asked for as the job "
                       f"starts; give a longer --time or a shorter --signal-seconds")
        if self.launcher not in LAUNCHERS:
            out.append(f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        return out


def render(req: SlurmRequest, job_expression: str | None = None) -> str:
    """The sbatch script for ``req``; ``job_expression`` replaces the quoted job path with
    shell text (``"$1"`` in the scripts of ``slurm/``)."""
    lines = ["#!/usr/bin/env bash",
             f"#SBATCH --job-name={req.name}",
             f"#SBATCH --nodes={req.nodes}",
             f"#SBATCH --ntasks-per-node={req.ranks_per_node}"]
    if req.gpus:
        lines.append("#SBATCH --gpus-per-task=1")
    if req.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={req.cpus_per_task}")
    lines.append(f"#SBATCH --time={req.time}")
    if req.partition:
        lines.append(f"#SBATCH --partition={req.partition}")
    if req.account:
        lines.append(f"#SBATCH --account={req.account}")
    lines += [f"#SBATCH --signal=B:USR1@{req.signal_seconds}",
              "#SBATCH --requeue",
              "#SBATCH --open-mode=append",
              "#SBATCH --output=%x-%j.out"]
    sets = list(req.sets) + [f"{'train' if req.training else 'generate'}.resume=auto"]
    extra = "".join(f" --set {shlex.quote(s)}" for s in sets)
    return "\n".join(lines) + _BODY.format(
        launcher=LAUNCHERS[req.launcher], job=job_expression or shlex.quote(req.job),
        resume=extra,
        kind="training" if req.training else "generation").rstrip("\n")


_BODY = r"""

# ---- the environment that matters, in one place -------------------------------------------
# threads per rank: the cores Slurm gave the task (BLAS and OpenMP)
export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}}
export OPENBLAS_NUM_THREADS=$OMP_NUM_THREADS MKL_NUM_THREADS=$OMP_NUM_THREADS
export HPCPAR_BACKEND=${{HPCPAR_BACKEND:-auto}}        # auto: CuPy when a GPU is there
HPCPAR_COMM=${{HPCPAR_COMM:-auto}}                      # tp/dp: auto (NCCL when usable) | mpi | nccl
export HPCPAR_CUDA_AWARE=${{HPCPAR_CUDA_AWARE:-auto}}  # MPI gets device buffers: auto (the library says) | 1 | 0
# MPI: srun with the PMI your MPI was built for (pmi2 for the mpich wheel, pmix for most site
# Open MPIs); where srun cannot start your MPI, set HPCPAR_LAUNCH=mpirun (the site's).
HPCPAR_LAUNCH=${{HPCPAR_LAUNCH:-{launcher}}}

# ---- time limit: USR1 arrives before it; the ranks save at a step boundary, exit 3 --------
forward() {{ echo "hpcpar: time limit near: asking the {kind} to stop at a step boundary"
            kill -USR1 "$child" 2>/dev/null || true; }}
trap forward USR1

echo "hpcpar: start $(date -Is) on $SLURM_JOB_NUM_NODES node(s), restart ${{SLURM_RESTART_COUNT:-0}}"
$HPCPAR_LAUNCH python -m hpcpar run {job} --comm "$HPCPAR_COMM"{resume} &
child=$!
while :; do                                 # wait returns early when the trap runs
  wait "$child"; status=$?
  kill -0 "$child" 2>/dev/null || break
done
if [ "$status" -eq 3 ]; then
  echo "hpcpar: saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


def submit(req: SlurmRequest, dry_run: bool = False) -> str:
    """Queue the job with ``sbatch`` and return its id, or return the script (``dry_run``)."""
    script = render(req)
    if dry_run:
        return script
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise HpcparError("sbatch not found: run 'hpcpar submit' on a Slurm login node, or "
                          "use --dry-run to print the script")
    proc = subprocess.run([sbatch, "--parsable"], input=script, capture_output=True, text=True,
                          cwd=Path.cwd())
    if proc.returncode:
        raise HpcparError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def check_layout(job, world_size: int, training: bool) -> None:
    """The job's layout on ``world_size`` ranks, with the errors a run would give."""
    from ..checkpoint import open_checkpoint, preset_config
    from ..models.config import ConfigError, ModelConfig
    from ..parallel.pipeline.training_schedules import micro_batch_problems
    from .job import PRESET_PREFIX
    spec = job.model.checkpoint
    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX):]
        cfg = ModelConfig.from_hf(preset_config(name), source=f"preset {name}")
    else:
        cfg = open_checkpoint(spec).config
    layout = job.parallel.layout(world_size, "1f1b" if training else "gpipe")
    problems = layout.problems(cfg, world_size)
    if training and not problems:
        problems += micro_batch_problems(layout.schedule, layout.pp, layout.micro_batches,
                                         job.parallel.virtual_stages)
        per_step = layout.dp * layout.micro_batches
        if job.train.global_batch % per_step:
            problems.append(f"global batch {job.train.global_batch} is not divisible by "
                            f"dp * micro_batches = {layout.dp} * {layout.micro_batches} = "
                            f"{per_step}")
    if problems:
        raise ConfigError(f"invalid parallel layout for {world_size} ranks", problems)


def static_scripts() -> dict[str, str]:
    """The scripts of ``slurm/`` (``sbatch slurm/train.sbatch JOB.toml``), by file name."""
    out = {}
    for kind, training in (("train", True), ("generate", False)):
        usage = f'"${{1:?usage: sbatch [options] slurm/{kind}.sbatch JOB.toml}}"'
        out[f"{kind}.sbatch"] = render(SlurmRequest("", training, name=f"hpcpar-{kind}"),
                                       job_expression=usage) + "\n"
    return out
