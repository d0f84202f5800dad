"""Command line: ``python -m hpcpar [COMMAND ...]`` on one rank or under ``mpiexec -n N``.

    python -m hpcpar                                  the demo job (same as 'demo')
    python -m hpcpar demo [--checkpoint C.h5] [--dp D --pp P --tp T]
    python -m hpcpar convert HF_DIR OUT.h5 [--dtype float32|float16|bfloat16]
    python -m hpcpar init --preset NAME OUT.h5 [--seed N] [--dtype ...]

Every rank parses the same arguments and validates the same inputs; problems are agreed on
and printed once (see ``hpcpar.launch``). Serial commands (convert, init) run on rank 0.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import __version__
from .errors import HpcparError
from .launch import check_launch, everyone, phase, run_guarded, world


class _Parser(argparse.ArgumentParser):
    """argparse that reports through hpcpar's agreed errors and prints help on rank 0 only."""

    def error(self, message):
        raise HpcparError(f"{self.prog}: {message} (see --help)")

    def _print_message(self, message, file=None):
        if world().Get_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    from .backend import BACKENDS
    from .checkpoint import PRESETS
    from .comm import COMM_KINDS
    from .dtypes import FLOAT_DTYPES

    p = _Parser(prog="hpcpar", description="Run Llama-family models across ranks with MPI.")
    p.add_argument("--version", action="version", version=f"hpcpar {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    demo = sub.add_parser("demo", help="the built-in demo job (the default command)")
    demo.add_argument("--checkpoint", help="checkpoint to load (default: a cached demo model)")
    for axis in ("dp", "pp", "tp"):
        demo.add_argument(f"--{axis}", type=int, help=f"{axis} size (default: inferred)")
    demo.add_argument("--backend", choices=BACKENDS, default="auto")
    demo.add_argument("--comm", choices=COMM_KINDS, default="auto",
                      help="tensor-parallel communicator")

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
    if command == "convert":
        from .checkpoint import convert
        return _on_rank0(comm, f"converting {args.hf_dir}", args.out,
                         lambda: convert(args.hf_dir, args.out, args.dtype))
    if command == "init":
        from .checkpoint import init_checkpoint
        from .dtypes import float_dtype
        return _on_rank0(comm, f"initialising preset {args.preset}", args.out,
                         lambda: init_checkpoint(args.out, args.preset, args.seed,
                                                 float_dtype(args.dtype)))
    raise AssertionError(command)


def _on_rank0(comm, what: str, out: Path, work) -> int:
    """Run a serial command on rank 0 while the other ranks wait for its verdict."""
    def run():
        if comm.Get_rank() != 0:
            return
        start = time.perf_counter()
        cfg = work()
        size = out.stat().st_size
        print(f"wrote {out} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
              f"vocab {cfg.vocab_size}, {size / 1e6:.1f} MB) in "
              f"{time.perf_counter() - start:.1f} s")

    with phase(what):
        everyone(comm, run)
    return 0
