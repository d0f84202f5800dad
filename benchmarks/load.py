"""Checkpoint loading: each rank's sliced read for tp = 1, 2, 4, 8 against whole-tensor reads.

    python benchmarks/load.py --preset 100m                 # one process
    mpiexec -n 4 python benchmarks/load.py --preset 100m    # 4 readers at once

Every rank loads the full model's tensors (one pipeline stage) as tp rank ``world_rank % tp``
of tp ranks, concurrently with the other ranks, and reports the bytes it read and the time.
Baselines in the same run, same ranks: every tensor read whole with h5py (what a loader that
slices after reading does), and the same weights loaded whole from a safetensors file when
safetensors is installed. The page cache is warm for all of them (the file was just written or
read), so the figures compare work done, not disk speed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcpar.checkpoint import init_checkpoint, load_shard, open_checkpoint, read_tensor
from hpcpar.models.tensors import model_tensors


def slowest(comm, seconds: float) -> float:
    out = np.empty(1)
    comm.Allreduce(np.array([seconds]), out, op=MPI.MAX)
    return float(out[0])


def timed(comm, fn, repeat: int) -> tuple[float, object]:
    """Best-of-``repeat`` time of the slowest rank, and fn's last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        result = fn()
        best = min(best, slowest(comm, time.perf_counter() - start))
    return best, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="100m")
    p.add_argument("--checkpoint", help="an existing checkpoint instead of a preset")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    tmp = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcpar-load-") if rank == 0 else None))
    path = Path(args.checkpoint) if args.checkpoint else tmp / f"{args.preset}.h5"
    if rank == 0 and not args.checkpoint:
        init_checkpoint(path, args.preset, seed=0, dtype=np.dtype(args.dtype))
    comm.Barrier()
    ckpt = open_checkpoint(path)
    specs = model_tensors(ckpt.config)
    model_bytes = sum(s.numel for s in specs) * ckpt.dtype.itemsize

    safetensors_path = None
    try:
        from safetensors.numpy import load_file, save_file
        safetensors_path = tmp / "model.safetensors"
        if rank == 0:
            save_file({s.name: read_tensor(ckpt, s.name) for s in specs}, str(safetensors_path))
        comm.Barrier()
    except ImportError:
        pass

    t_whole, _ = timed(comm, lambda: [read_tensor(ckpt, s.name) for s in specs], args.repeat)
    t_st = (timed(comm, lambda: load_file(str(safetensors_path)), args.repeat)[0]
            if safetensors_path else float("nan"))
    if rank == 0:
        print(f"# {path.name}: {len(specs)} tensors, {model_bytes / 1e6:.1f} MB "
              f"{ckpt.dtype.name}; {world} reader(s) at once; best of {args.repeat}")
        print(f"# baselines per rank: h5py whole tensors {t_whole * 1e3:.1f} ms, "
              f"safetensors whole file {t_st * 1e3:.1f} ms ({model_bytes / 1e6:.1f} MB each)")
        print(f"{'tp':>3} {'MB read/rank':>13} {'of model':>9} {'ms/rank':>9} "
              f"{'vs h5py whole':>14} {'vs safetensors':>15}")
    for tp in (1, 2, 4, 8):
        if tp not in ckpt.config.valid_tp_sizes(8):
            continue
        t, shard = timed(comm, lambda: load_shard(ckpt, specs, rank % tp, tp), args.repeat)
        read = np.empty(1)
        comm.Allreduce(np.array([float(shard.bytes_read)]), read, op=MPI.MAX)
        if rank == 0:
            print(f"{tp:>3} {read[0] / 1e6:>13.1f} {read[0] / model_bytes:>9.3f} "
                  f"{t * 1e3:>9.1f} {t / t_whole:>14.2f} {t / t_st:>15.2f}")
    comm.Barrier()
    if rank == 0:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    main()
