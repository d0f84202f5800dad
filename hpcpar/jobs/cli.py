"""Command line: ``python -m hpcpar [COMMAND ...]`` on one rank or under ``mpiexec -n N``.

    mpiexec -n 8 python -m hpcpar                     the demo job (same as 'demo')
    mpiexec -n 8 python -m hpcpar run JOB.toml [--set section.key=value ...] [flags]
    mpiexec -n 8 python -m hpcpar generate --checkpoint C.h5 --prompts P --max-new-tokens N
                 --out OUT.h5|OUT.jsonl [--tp T --pp P --dp D --micro-batches M]
                 [--temperature X --top-k K --top-p P --seed S] [--save-logits]
    mpiexec -n 8 python -m hpcpar score --checkpoint C.h5 --data D --out OUT.h5
                 [--tp T --pp P --dp D --micro-batches M]
    mpiexec -n 8 python -m hpcpar train --checkpoint C.h5 --data D --steps N --global-batch B
                 --out DIR [...]
    python -m hpcpar plan [JOB.toml] [--checkpoint C.h5 | --preset NAME] [--world N] [...]
    python -m hpcpar convert HF_DIR OUT.h5 [--dtype float32|float16|bfloat16]
    python -m hpcpar export CKPT.h5 DIR [--dtype ...] [--shard-size 5GB] [--lora | --merge-lora]
    python -m hpcpar show OUT [--json] [--page K] [--per-page N] [--plot OUT.png]
    python -m hpcpar init --preset NAME OUT.h5 [--seed N] [--dtype ...]
    python -m hpcpar submit JOB.toml [--nodes N --ranks-per-node R ...]

Every command's flags: ``python -m hpcpar COMMAND --help``, and the command block of
docs/reference/cli.md (``tests/test_env_and_help.py`` keeps the two equal).

Every rank parses the same arguments and validates the same inputs; problems are agreed on
and printed once (see ``hpcpar.jobs.launch``). Serial commands (convert, export, init, plan,
show) run on rank 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from ..parallel.device import waits
from ..parallel.errors import HpcparError, Stopped
from .launch import (EXIT_PREEMPTED, EXIT_REQUESTS_FAILED, JobFailed, StopRequest,
                     check_launch, everyone, phase, run_guarded, world)
from .parser import FLAG_NAMES, JOB_FLAGS, TRAIN_FLAGS, build_parser


def main(argv: list[str] | None = None) -> int:
    return run_guarded(lambda: _main(argv))


def _main(argv) -> int:
    comm = world()
    everyone(comm, check_launch, comm)
    from . import faults, settings
    everyone(comm, settings.check_environment, comm.Get_size())     # every HPCPAR_* variable
    everyone(comm, faults.check_environment, comm.Get_size())
    args = everyone(comm, build_parser().parse_args, argv)
    command = args.command or "demo"
    if command == "demo":
        from .demo import DemoOptions, run_demo
        opts = DemoOptions(**{k: getattr(args, k, None) for k in ("checkpoint", "dp", "pp", "tp")},
                           backend=getattr(args, "backend", "auto"),
                           comm=getattr(args, "comm", "auto"),
                           trace=getattr(args, "trace", None))
        return run_demo(comm, opts)
    if command == "score" or (command == "run" and everyone(comm, _is_scoring, args)):
        from .job import check_same_job, load_job
        flags = {JOB_FLAGS[k]: v for k, v in vars(args).items()
                 if k in JOB_FLAGS and k != "prompts"}
        if getattr(args, "data", None) is not None:       # score's, or run's of a [score] job
            flags[("score", "data")] = args.data
        flags[("score", "prefix_cache")] = flags.pop(JOB_FLAGS["prefix_cache"], None)
        job = everyone(comm, load_job, getattr(args, "job", None), args.set, flags, FLAG_NAMES)
        everyone(comm, check_same_job, comm, job)
        return _score(comm, job)
    if command in ("run", "generate", "train"):
        from .job import check_same_job, load_job
        job_file = getattr(args, "job", None)
        training = command == "train" or (command == "run" and everyone(
            comm, _is_training, job_file, args))
        flags = {JOB_FLAGS[k]: v for k, v in vars(args).items() if k in JOB_FLAGS}
        flags.update({TRAIN_FLAGS[k]: v for k, v in vars(args).items() if k in TRAIN_FLAGS})
        if training:
            flags.pop(JOB_FLAGS["seed"], None)
            flags[("train", "seed")] = getattr(args, "seed", None)
        else:                                   # --resume of a generation job
            flags[("generate", "resume")] = flags.pop(TRAIN_FLAGS["resume"], None) or getattr(
                args, "resume", None)
        job = everyone(comm, load_job, job_file, args.set, flags, FLAG_NAMES)
        everyone(comm, check_same_job, comm, job)
        if training:
            return _train(comm, job)
        from .generate import run_generation
        result = run_generation(comm, job)
        failed = np.zeros(1, np.int64)             # Batch API requests not served
        if result is not None:
            print(result.report.format())
            if result.requests is not None:
                print(f"batch: {result.requests.summary()}")
                failed[0] = len(result.requests.failed)
            if job.output.path:
                print(f"wrote {job.output.path}")
        if comm.Get_size() > 1:                  # every rank exits with rank 0's status
            waits.wait_bounded(comm.Ibcast(failed, root=0), waits.limit(),
                               "agreeing on the exit status")
        return EXIT_REQUESTS_FAILED if failed[0] else 0
    if command == "submit":
        return _on_rank0(comm, "submitting the job", lambda: _submit(args))
    if command == "plan":
        return _on_rank0(comm, "planning", lambda: print(_plan_text(args)))
    if command == "convert":
        from ..checkpoint import convert
        return _on_rank0(comm, f"converting {args.hf_dir}",
                         _wrote(args.out, lambda: convert(args.hf_dir, args.out, args.dtype)))
    if command == "export":
        return _on_rank0(comm, f"exporting {args.checkpoint}", lambda: _export(args))
    if command == "show":
        return _on_rank0(comm, f"showing {args.path}", lambda: _show(args))
    if command == "init":
        from ..checkpoint import init_checkpoint
        from ..parallel.device.dtypes import float_dtype
        return _on_rank0(comm, f"initialising preset {args.preset}", _wrote(
            args.out, lambda: init_checkpoint(args.out, args.preset, args.seed,
                                              float_dtype(args.dtype))))
    raise AssertionError(command)


def _export(args) -> None:
    """A stop request (SIGTERM, SIGUSR1, Ctrl-C) ends the export before its next tensor, as
    it ends a scoring: one line, no folder, status 3."""
    from ..checkpoint.export import export, parse_size
    start = time.perf_counter()
    with StopRequest() as stop:
        def check_stop():
            if stop.requested:
                raise Stopped(stop.signal_name, 0)

        try:
            files = _export_lora(args, check_stop) or export(
                args.checkpoint, args.out, args.dtype, parse_size(args.shard_size), check_stop)
        except Stopped as e:
            print(f"hpcpar: stopped on request ({e}) while exporting: nothing was written; "
                  "run it again to export", file=sys.stderr, flush=True)
            raise JobFailed(EXIT_PREEMPTED) from None
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {args.out} ({len(files)} files, {size / 1e6:.1f} MB) in "
          f"{time.perf_counter() - start:.1f} s")


def _export_lora(args, check_stop) -> list | None:
    """``export --lora`` (a peft folder) and ``--merge-lora`` (the base, merged) of a LoRA
    run's checkpoint, which holds its adapter only (so a plain export of it is refused)."""
    from ..checkpoint.export import export, parse_size
    from ..checkpoint import peft
    if args.lora:
        if args.dtype is not None:
            raise HpcparError("--lora writes the adapter in float32, as peft saves it; leave "
                              "--dtype out")
        return peft.export_adapter(args.checkpoint, args.out)
    if args.merge_lora:
        base, add = peft.merged_export_args(args.checkpoint)
        return export(base, args.out, args.dtype, parse_size(args.shard_size), check_stop, add)
    if peft.run_settings(args.checkpoint):
        raise HpcparError(f"{args.checkpoint} is a LoRA run's checkpoint: it holds the adapter "
                          "only; export it with --lora (a peft folder) or --merge-lora (the "
                          "base with the adapter merged)")
    return None


def _show(args) -> None:
    from .show import PAGE, format_summary, summary
    page = 1 if args.page is None else args.page
    per_page = PAGE if args.per_page is None else args.per_page
    if page < 1 or per_page < 1:
        raise HpcparError(f"--page {page} --per-page {per_page}: both count from 1")
    s = summary(args.path, page, per_page)
    if "pages" not in s and (args.page, args.per_page) != (None, None):
        raise HpcparError(f"--page and --per-page page a generation or scoring output's rows; "
                          f"{args.path} is a {s['kind']}, which shows whole")
    if args.plot:
        from .plots import plot
        plot(args.path, s, args.plot)
    print(json.dumps(s, allow_nan=True) if args.json else format_summary(s))
    if args.plot and not args.json:
        print(f"wrote {args.plot}")


def _submit(args) -> None:
    from .job import load_job
    from .slurm import SlurmRequest, check_layout, submit
    training = _is_training(args.job, args)
    job = load_job(args.job, args.set)
    req = SlurmRequest(str(args.job), training, args.nodes, args.ranks_per_node,
                       args.gpus_per_node, args.cpus_per_task, args.time, args.partition,
                       args.account, args.signal_seconds, args.job.stem, args.launcher,
                       tuple(args.set))
    problems = req.problems()
    if problems:
        raise HpcparError("hpcpar submit: " + "; ".join(problems))
    check_layout(job, req.ranks, training)
    out = submit(req, dry_run=args.dry_run)
    print(out if args.dry_run else f"submitted batch job {out}")


def _is_training(job_file, args) -> bool:
    """A job trains when its file has a [train] section or a training flag or --set says so."""
    from .job import read_job_file
    raw = read_job_file(job_file) if job_file is not None else {}
    return ("train" in raw or any(a.startswith("train.") for a in args.set)
            or any(getattr(args, k, None) is not None for k in TRAIN_FLAGS if k != "resume"))


def _is_scoring(args) -> bool:
    """A job file scores when it has a [score] section, or --set says so."""
    from .job import read_job_file
    raw = read_job_file(args.job)
    return "score" in raw or any(a.startswith("score.") for a in args.set)


def _score(comm, job) -> int:
    from .score import run_scoring
    result = run_scoring(comm, job)
    if result is not None:
        print(result.format())
        print(f"wrote {job.output.path}")
    return 0


def _train(comm, job) -> int:
    from .train.engine import run_training
    report = run_training(comm, job)

    def save():
        if report is not None:
            report.save(Path(job.output.path) / "report.json")

    everyone(comm, save)                 # rank 0 writes; a failure ends every rank
    if report is not None:
        print(report.format())
        print(f"wrote {job.output.path}")
    return 0


def _plan_config(path: Path):
    """The model of a Hugging Face ``config.json`` (or of the folder holding one, its weights
    unread): ``plan`` sizes a model before it is downloaded or converted. None: a checkpoint."""
    from ..models.config import ModelConfig
    config = path / "config.json" if path.is_dir() else path
    if config.suffix != ".json" or not config.is_file():
        return None
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise HpcparError(f"{config}: not a readable config.json ({e})") from None
    return ModelConfig.from_hf(hf, source=str(config))


def _plan_text(args) -> str:
    from ..checkpoint import open_checkpoint, preset_config
    from ..models.config import ModelConfig
    from ..parallel.device.dtypes import float_dtype
    from .job import PRESET_PREFIX, load_job

    flags = {("parallel", k): getattr(args, k) for k in
             ("dp", "pp", "tp", "cp", "ep", "micro_batches", "stage_layers", "schedule",
              "virtual_stages", "sequence_parallel")}
    flags.update({("train", k): getattr(args, k) for k in
                  ("global_batch", "seq_len", "optimizer", "recompute", "zero")})
    flags[("train", "fused")] = args.fused_optimizer
    flags[("model", "dtype")] = args.dtype
    flags[("model", "checkpoint")] = (PRESET_PREFIX + args.preset if args.preset
                                      else args.checkpoint)
    flags[("generate", "max_new_tokens")] = args.max_new_tokens
    job = load_job(args.job, args.set, flags)
    spec = job.model.checkpoint
    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX):]
        cfg = ModelConfig.from_hf(preset_config(name), source=f"preset {name}")
    else:
        name = spec
        cfg = _plan_config(Path(spec)) or open_checkpoint(spec).config
    par = job.parallel
    world_size = args.world or (par.dp or 1) * (par.pp or 1) * par.cp * (par.tp or 1)
    training = args.train or _is_training(args.job, args)
    layout = par.layout(world_size, "1f1b" if training else "gpipe")
    layout.check(cfg, world_size)
    if training:
        from .plan import format_train_plan
        from .train.setup import plan_problems
        problems = plan_problems(job, cfg, layout, world_size)
        if problems:                     # what train refuses, plan does: nothing to size
            raise HpcparError("invalid training job: " + "; ".join(problems))
        return format_train_plan(cfg, layout, par.virtual_stages, job.train, name,
                                 bool(par.sequence_parallel),
                                 float_dtype(job.model.dtype).itemsize)
    if layout.cp > 1:
        raise HpcparError(f"cp {layout.cp}: plan counts a cp split for training (--train); "
                          "its generation plan (weights, KV cache) does not split over cp yet")
    from .plan import format_plan
    return format_plan(cfg, layout, args.batch or job.data.random_count,
                       args.prompt_length or max(job.data.random_lengths),
                       job.generate.max_new_tokens, float_dtype(job.model.dtype).itemsize, name,
                       job.generate)


def _wrote(out: Path, work):
    def run():
        start = time.perf_counter()
        cfg = work()
        print(f"wrote {out} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
              f"vocab {cfg.vocab_size}, {out.stat().st_size / 1e6:.1f} MB) in "
              f"{time.perf_counter() - start:.1f} s")
    return run


def _on_rank0(comm, what: str, work) -> int:
    """Run a serial command on rank 0 while the other ranks wait for its verdict."""
    def run():
        if comm.Get_rank() == 0:
            work()

    with phase(what):
        everyone(comm, run)
    return 0
