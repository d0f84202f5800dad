"""Command line: ``python -m hpcpar [COMMAND ...]`` on one rank or under ``mpiexec -n N``.

    mpiexec -n 8 python -m hpcpar                     the demo job (same as 'demo')
    mpiexec -n 8 python -m hpcpar run JOB.toml [--set section.key=value ...] [flags]
    mpiexec -n 8 python -m hpcpar generate --checkpoint C.h5 --prompts P --max-new-tokens N
                 --out OUT.h5 [--tp T --pp P --dp D --micro-batches M]
                 [--temperature X --top-k K --top-p P --seed S] [--save-logits]
    python -m hpcpar plan [JOB.toml] [--checkpoint C.h5 | --preset NAME] [--world N] [...]
    python -m hpcpar convert HF_DIR OUT.h5 [--dtype float32|float16|bfloat16]
    python -m hpcpar init --preset NAME OUT.h5 [--seed N] [--dtype ...]

Every rank parses the same arguments and validates the same inputs; problems are agreed on
and printed once (see ``hpcpar.launch``). Serial commands (convert, init, plan) run on rank 0.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import __version__
from .errors import HpcparError
from .launch import check_launch, everyone, phase, run_guarded, world

# flag dest -> (job section, key)
JOB_FLAGS = {
    "checkpoint": ("model", "checkpoint"), "dtype": ("model", "dtype"),
    "prompts": ("data", "prompts"),
    "dp": ("parallel", "dp"), "pp": ("parallel", "pp"), "tp": ("parallel", "tp"),
    "micro_batches": ("parallel", "micro_batches"), "stage_layers": ("parallel", "stage_layers"),
    "backend": ("parallel", "backend"), "comm": ("parallel", "comm"),
    "max_new_tokens": ("generate", "max_new_tokens"),
    "temperature": ("generate", "temperature"), "top_k": ("generate", "top_k"),
    "top_p": ("generate", "top_p"), "seed": ("generate", "seed"),
    "save_logits": ("generate", "save_logits"), "stop_at_eos": ("generate", "stop_at_eos"),
    "out": ("output", "path"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports through hpcpar's agreed errors and prints help on rank 0 only."""

    def error(self, message):
        raise HpcparError(f"{self.prog}: {message} (see --help)")

    def _print_message(self, message, file=None):
        if world().Get_rank() == 0:
            super()._print_message(message, file)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _layout_flags(p, stage_layers: bool = True) -> None:
    for axis in ("dp", "pp", "tp"):
        p.add_argument(f"--{axis}", type=int, help=f"{axis} size (default: inferred)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per replica")
    if stage_layers:
        p.add_argument("--stage-layers", type=_int_list, metavar="N,N,...",
                       help="layers per pipeline stage (default: even, remainder first)")


def _job_flags(p, required: bool) -> None:
    from .backend import BACKENDS
    from .comm import COMM_KINDS
    need = {"required": required}
    p.add_argument("--checkpoint", **need, help="HDF5 checkpoint, or preset:NAME")
    p.add_argument("--prompts", **need, help=".npy of ids, .jsonl of {ids} or {text}, or random")
    p.add_argument("--max-new-tokens", type=int, **need)
    p.add_argument("--out", **need, help="output HDF5 file")
    _layout_flags(p)
    p.add_argument("--temperature", type=float, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--save-logits", action="store_const", const=True,
                   help="store the logits of every prompt position")
    p.add_argument("--ignore-eos", dest="stop_at_eos", action="store_const", const=False,
                   help="always generate max-new-tokens, past EOS")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"],
                   help="compute dtype (default float32)")
    p.add_argument("--backend", choices=BACKENDS)
    p.add_argument("--comm", choices=COMM_KINDS, help="tensor-parallel communicator")


def build_parser() -> argparse.ArgumentParser:
    from .backend import BACKENDS
    from .checkpoint import PRESETS
    from .comm import COMM_KINDS
    from .dtypes import FLOAT_DTYPES

    p = _Parser(prog="hpcpar", description="Run Llama-family models across ranks with MPI.")
    p.add_argument("--version", action="version", version=f"hpcpar {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    demo = sub.add_parser("demo", help="the built-in demo job (the default command)")
    demo.add_argument("--checkpoint", help="checkpoint (default: a cached random tiny model)")
    for axis in ("dp", "pp", "tp"):
        demo.add_argument(f"--{axis}", type=int, help=f"{axis} size (default: chosen for N)")
    demo.add_argument("--backend", choices=BACKENDS, default="auto")
    demo.add_argument("--comm", choices=COMM_KINDS, default="auto",
                      help="tensor-parallel communicator")

    run = sub.add_parser("run", help="run a job file (TOML)")
    run.add_argument("job", type=Path)
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a job setting (repeatable)")
    _job_flags(run, required=False)

    gen = sub.add_parser("generate", help="batch generation from prompts")
    gen.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    _job_flags(gen, required=True)

    plan = sub.add_parser("plan", help="memory, communication and bubble of a layout (no MPI)")
    plan.add_argument("job", nargs="?", type=Path, help="job file to plan (optional)")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="read the model config from this checkpoint")
    source.add_argument("--preset", choices=sorted(PRESETS), help="plan a preset model")
    plan.add_argument("--world", type=int, help="number of ranks (default: dp*pp*tp)")
    _layout_flags(plan)
    plan.add_argument("--batch", type=int, help="prompts in the batch")
    plan.add_argument("--prompt-length", type=int, help="longest prompt, in tokens")
    plan.add_argument("--max-new-tokens", type=int)
    plan.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"])

    conv = sub.add_parser("convert", help="Hugging Face folder -> HDF5 checkpoint")
    conv.add_argument("hf_dir", type=Path)
    conv.add_argument("out", type=Path)
    conv.add_argument("--dtype", choices=[d for d in FLOAT_DTYPES if d != "float64"],
                      help="storage dtype (default: the weights' own)")

    init = sub.add_parser("init", help="random weights for a named model shape")
    init.add_argument("--preset", required=True, choices=sorted(PRESETS))
    init.add_argument("out", type=Path)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=[d for d in FLOAT_DTYPES if d != "float64"],
                      default="float32")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_guarded(lambda: _main(argv))


def _main(argv) -> int:
    comm = world()
    everyone(comm, check_launch, comm)
    args = everyone(comm, build_parser().parse_args, argv)
    command = args.command or "demo"
    if command == "demo":
        from .demo import DemoOptions, run_demo
        opts = DemoOptions(**{k: getattr(args, k, None) for k in ("checkpoint", "dp", "pp", "tp")},
                           backend=getattr(args, "backend", "auto"),
                           comm=getattr(args, "comm", "auto"))
        return run_demo(comm, opts)
    if command in ("run", "generate"):
        from .generate import run_generation
        from .jobs import load_job
        flags = {JOB_FLAGS[k]: v for k, v in vars(args).items() if k in JOB_FLAGS}
        job = everyone(comm, load_job, getattr(args, "job", None), args.set, flags)
        result = run_generation(comm, job)
        if result is not None:
            print(result.report.format())
            if job.output.path:
                print(f"wrote {job.output.path}")
        return 0
    if command == "plan":
        return _on_rank0(comm, "planning", lambda: print(_plan_text(args)))
    if command == "convert":
        from .checkpoint import convert
        return _on_rank0(comm, f"converting {args.hf_dir}",
                         _wrote(args.out, lambda: convert(args.hf_dir, args.out, args.dtype)))
    if command == "init":
        from .checkpoint import init_checkpoint
        from .dtypes import float_dtype
        return _on_rank0(comm, f"initialising preset {args.preset}", _wrote(
            args.out, lambda: init_checkpoint(args.out, args.preset, args.seed,
                                              float_dtype(args.dtype))))
    raise AssertionError(command)


def _plan_text(args) -> str:
    from .checkpoint import open_checkpoint, preset_config
    from .config import LlamaConfig
    from .dtypes import float_dtype
    from .jobs import PRESET_PREFIX, load_job

    flags = {("parallel", k): getattr(args, k) for k in
             ("dp", "pp", "tp", "micro_batches", "stage_layers")}
    flags[("model", "dtype")] = args.dtype
    flags[("model", "checkpoint")] = (PRESET_PREFIX + args.preset if args.preset
                                      else args.checkpoint)
    flags[("generate", "max_new_tokens")] = args.max_new_tokens
    job = load_job(args.job, args.set, flags)
    spec = job.model.checkpoint
    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX):]
        cfg = LlamaConfig.from_hf(preset_config(name), source=f"preset {name}")
    else:
        name = spec
        cfg = open_checkpoint(spec).config
    par = job.parallel
    world_size = args.world or (par.dp or 1) * (par.pp or 1) * (par.tp or 1)
    layout = par.layout(world_size)
    layout.check(cfg, world_size)
    from .plan import format_plan
    return format_plan(cfg, layout, args.batch or job.data.random_count,
                       args.prompt_length or max(job.data.random_lengths),
                       job.generate.max_new_tokens, float_dtype(job.model.dtype).itemsize, name)


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
