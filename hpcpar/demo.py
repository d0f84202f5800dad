"""The built-in demo job: ``mpiexec -n 8 python -m hpcpar``.

Creates a small random checkpoint in a cache folder (once), picks a layout for the world size,
loads every rank's slices, checks over the tp, pp and dp groups that they add up to the file,
and prints a report: layout, what each rank read, load time, bytes communicated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import select_backend
from .checkpoint import Checkpoint, init_checkpoint, load_shard, open_checkpoint, read_tensor
from .comm import CommStats, create_communicator
from .config import LlamaConfig, ParallelConfig
from .launch import everyone, phase, set_location
from .mesh import Mesh
from .pipeline.partition import stage_layers
from .sharding import shard_of
from .tensors import TensorSpec, stage_tensors

DEMO_PRESET = "tiny"
DEMO_SEED = 0


def cache_dir() -> Path:
    root = os.environ.get("HPCPAR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcpar")
    return Path(root)


def demo_layout(world_size: int, cfg: LlamaConfig) -> ParallelConfig:
    """A layout that shows every axis the world size allows: tp 2 and pp 2 where they fit,
    the rest as data-parallel replicas (8 ranks -> dp 2 × pp 2 × tp 2)."""
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


def _owned_sum(spec: TensorSpec, local: np.ndarray, cfg: LlamaConfig, tp_rank: int,
               tp_size: int) -> float:
    """Sum of the part of ``local`` this rank is the first holder of, so that summing over a
    tp group counts every element of the full tensor exactly once."""
    shard = shard_of(spec, cfg, tp_rank, tp_size)
    first = next(r for r in range(tp_size) if shard_of(spec, cfg, r, tp_size).source == shard.source)
    if first != tp_rank:
        return 0.0
    return float(np.asarray(local[shard.dest], dtype=np.float64).sum())


def run_demo(comm, opts: DemoOptions) -> int:
    rank, size = comm.Get_rank(), comm.Get_size()
    path = Path(opts.checkpoint) if opts.checkpoint else (
        cache_dir() / f"demo-{DEMO_PRESET}-seed{DEMO_SEED}.h5")

    def ensure_checkpoint():
        if rank == 0 and opts.checkpoint is None and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            init_checkpoint(path, DEMO_PRESET, seed=DEMO_SEED)

    with phase("creating the demo checkpoint"):
        everyone(comm, ensure_checkpoint)
    ckpt: Checkpoint = everyone(comm, open_checkpoint, path)
    cfg = ckpt.config

    def choose_layout() -> ParallelConfig:
        if opts.dp is None and opts.pp is None and opts.tp is None:
            layout = demo_layout(size, cfg)
        else:
            layout = ParallelConfig.infer(size, dp=opts.dp, pp=opts.pp, tp=opts.tp)
        layout.check(cfg, size)
        return layout

    layout = everyone(comm, choose_layout)
    mesh = Mesh(comm, layout)
    set_location(mesh.describe())
    backend = everyone(comm, select_backend, opts.backend, _local_rank(comm))
    stats = CommStats()
    tp = create_communicator(mesh.tp_comm, opts.comm, backend, stats, "tp")
    pp = create_communicator(mesh.pp_comm, "mpi", backend, stats, "pp")
    dp = create_communicator(mesh.dp_comm, "mpi", backend, stats, "dp")

    layers = stage_layers(cfg.num_hidden_layers, layout.pp, mesh.pp_rank, layout.stage_layers)
    specs = stage_tensors(cfg, layers, mesh.is_first_stage, mesh.is_last_stage)
    with phase("loading the checkpoint"):
        shard = everyone(comm, load_shard, ckpt, specs, mesh.tp_rank, layout.tp,
                         backend=backend)

    # Check over every axis of the mesh: summing each rank's owned part of its slices over tp
    # gives its stage's tensors, over pp a whole replica; dp gathers every replica's sums.
    with phase("checking the loaded slices"):
        names = list(ckpt.tensors)
        sums = np.zeros(len(names), dtype=np.float64)
        for spec in specs:
            if spec.role == "embed" and not mesh.is_first_stage:
                continue  # the tied head's copy of the embedding, counted on stage 0
            local = backend.to_host(shard.tensors[spec.name])
            sums[names.index(spec.name)] = _owned_sum(spec, local, cfg, mesh.tp_rank, layout.tp)
        pp.all_reduce(tp.all_reduce(sums))
        replicas = dp.all_gather(sums[None, :], axis=0)  # (dp, tensors)
        mine = np.array([shard.bytes_read, shard.seconds, len(specs), layers.start,
                         len(layers)], dtype=np.float64)
        table = np.empty((size, mine.size), dtype=np.float64) if rank == 0 else None
        comm.Gather(mine, table, root=0)

    if rank == 0:
        expected = np.array([float(read_tensor(ckpt, n).astype(np.float64).sum()) for n in names])
        mismatch = [f"{n} (replica {d})" for d, row in enumerate(replicas)
                    for n, a, b in zip(names, row, expected)
                    if not np.isclose(a, b, rtol=1e-6, atol=1e-6)]
        _report(ckpt, layout, backend.name, tp.kind, table, stats, mismatch)
        if mismatch:
            return 1
    return 0


def _local_rank(comm) -> int:
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_rank()
    node.Free()
    return local


def _report(ckpt, layout, backend, comm_kind, table, stats, mismatch) -> None:
    cfg = ckpt.config
    model_bytes = sum(s.numel for s in ckpt.tensors.values()) * ckpt.dtype.itemsize
    print(f"hpcpar demo: {ckpt.path.name} ({cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {ckpt.dtype.name}, {model_bytes / 1e6:.2f} MB)")
    print(f"layout: dp {layout.dp} x pp {layout.pp} x tp {layout.tp} = {layout.world_size} "
          f"ranks; arrays on {backend}, tp collectives over {comm_kind}")
    print(f"{'rank':>4} {'dp':>3} {'pp':>3} {'tp':>3} {'layers':>8} {'tensors':>8} "
          f"{'MB read':>8} {'load ms':>8}")
    from .mesh import coords_of
    for r, (nbytes, secs, ntensors, first, count) in enumerate(table):
        c = coords_of(r, layout)
        span = f"{int(first)}-{int(first + count - 1)}"
        print(f"{r:>4} {c.dp_rank:>3} {c.pp_rank:>3} {c.tp_rank:>3} {span:>8} "
              f"{int(ntensors):>8} {nbytes / 1e6:>8.3f} {secs * 1e3:>8.1f}")
    total = table[:, 0].sum()
    print(f"read {total / 1e6:.3f} MB in all = {total / (layout.dp * model_bytes):.2f} x the "
          f"model per replica (replicated norms and KV heads are read by each tp rank)")
    print(f"communicated by rank 0: {stats.total_bytes} bytes "
          + ", ".join(f"{k} {v.calls}x" for k, v in stats.ops.items()))
    if mismatch:
        print(f"CHECK FAILED: slices do not add up to the file for {len(mismatch)} tensor(s), "
              f"first {mismatch[0]}")
    else:
        print(f"check: in each of the {layout.dp} replicas, the ranks' slices add up to the "
              f"file's {len(ckpt.tensors)} tensors")
