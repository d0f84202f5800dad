"""The built-in demo job: ``mpiexec -n 8 python -m hpcpar``.

Creates a small random checkpoint in a cache folder (once), picks a layout that shows every
axis the world size allows (8 ranks -> dp 2 x pp 2 x tp 2), generates 16 new tokens for 16
random prompts of different lengths through the pipeline, and prints the run report.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import open_checkpoint
from ..models.config import ModelConfig
from .generate import resolve_checkpoint, run_generation
from .job import (PRESET_PREFIX, DataSection, GenerateSection, Job, ModelSection, OutputSection,
                  ParallelSection)
from .launch import everyone
from .layout import ParallelConfig

DEMO_CHECKPOINT = PRESET_PREFIX + "tiny"


def demo_layout(world_size: int, cfg: ModelConfig) -> ParallelConfig:
    """tp 2 and pp 2 where they fit, the rest as data-parallel replicas."""
    tp = 2 if world_size % 2 == 0 and 2 in cfg.valid_tp_sizes(2) else 1
    rest = world_size // tp
    if rest % 2 == 0:
        pp = 2
    elif rest <= cfg.num_hidden_layers:
        pp = rest
    else:
        pp = 1
    return ParallelConfig(dp=rest // pp, pp=pp, tp=tp)


@dataclass
class DemoOptions:
    checkpoint: str | None = None
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    backend: str = "auto"
    comm: str = "auto"
    trace: str | None = None        # a timeline of every rank (``--trace``)


def demo_job(opts: DemoOptions, checkpoint: str, cfg: ModelConfig, world_size: int) -> Job:
    if opts.dp is None and opts.pp is None and opts.tp is None:
        layout = demo_layout(world_size, cfg)
        dp, pp, tp = layout.dp, layout.pp, layout.tp
    else:
        dp, pp, tp = opts.dp, opts.pp, opts.tp
    return Job(
        model=ModelSection(checkpoint=checkpoint),
        parallel=ParallelSection(dp=dp, pp=pp, tp=tp, micro_batches=2 * (pp or 1),
                                 backend=opts.backend, comm=opts.comm),
        data=DataSection(prompts="random", random_count=16, random_lengths=(4, 24)),
        generate=GenerateSection(max_new_tokens=16, stop_at_eos=False),
        output=OutputSection(trace=opts.trace))


def run_demo(comm, opts: DemoOptions) -> int:
    path = resolve_checkpoint(comm, opts.checkpoint or DEMO_CHECKPOINT)
    cfg = everyone(comm, open_checkpoint, path).config
    result = run_generation(comm, demo_job(opts, str(path), cfg, comm.Get_size()))
    if result is not None:
        made = " (random weights)" if opts.checkpoint is None else ""    # the demo's own
        print(f"hpcpar demo: {path.name}, {cfg.num_hidden_layers} layers, hidden "
              f"{cfg.hidden_size}, vocab {cfg.vocab_size}{made}")
        print(result.report.format())
        for row in range(2):
            print(f"prompt {row} ({result.prompt_lengths[row]} tokens) -> "
                  f"{result.tokens[row].tolist()}")
    return 0
