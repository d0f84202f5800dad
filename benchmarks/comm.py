"""Collective bandwidth, nccl-tests style, with hpcpar's overhead over raw mpi4py.

    mpiexec -n 4 python benchmarks/comm.py [--ops all_reduce,all_gather] [--max-bytes 64M]

For each operation and message size: the average time per call (slowest rank), algbw = S / t
and busbw (nccl-tests' formulas: all_reduce S/t * 2(n-1)/n; all_gather and reduce_scatter
S/t * (n-1)/n with S the gathered / scattered total; broadcast and sendrecv S/t), and the ratio
of hpcpar's time to the same operation done with raw mpi4py buffer calls in the same run
(1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from hpcpar.parallel.device.backend import select_backend
from hpcpar.parallel.comm import create_communicator

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def busbw_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def make_calls(op: str, comm, hp, nbytes: int, xp):
    """(hpcpar call, raw mpi4py call) moving ``nbytes`` (nccl-tests' S) of float32."""
    n, rank = comm.Get_size(), comm.Get_rank()
    count = max(1, nbytes // 4)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if op == "all_reduce":
        a, b = xp.ones(count, xp.float32), np.ones(count, np.float32)
        return (lambda: hp.all_reduce(a)), (lambda: comm.Allreduce(MPI.IN_PLACE, b))
    if op == "all_gather":  # S = gathered size
        per = max(1, count // n)
        a, b = xp.ones(per, xp.float32), np.ones(per, np.float32)
        out = np.empty(per * n, np.float32)
        hp_out = xp.empty(per * n, xp.float32)
        return (lambda: hp.all_gather(a, out=hp_out)), (lambda: comm.Allgather(b, out))
    if op == "reduce_scatter":  # S = input size
        per = max(1, count // n)
        a, b = xp.ones(per * n, xp.float32), np.ones(per * n, np.float32)
        out = np.empty(per, np.float32)
        hp_out = xp.empty(per, xp.float32)
        return ((lambda: hp.reduce_scatter(a, out=hp_out)),
                (lambda: comm.Reduce_scatter_block(b, out)))
    if op == "broadcast":
        a, b = xp.ones(count, xp.float32), np.ones(count, np.float32)
        return (lambda: hp.broadcast(a)), (lambda: comm.Bcast(b))
    if op == "sendrecv":  # a ring: every rank sends S bytes and receives S bytes
        a, ra = xp.ones(count, xp.float32), xp.empty(count, xp.float32)
        b, rb = np.ones(count, np.float32), np.empty(count, np.float32)
        return ((lambda: hp.sendrecv(a, nxt, ra, prv)),
                (lambda: comm.Sendrecv(b, nxt, 0, rb, prv, 0)))
    raise ValueError(op)


def timed(comm, call, iters: int, sync) -> float:
    """Seconds per call on the slowest rank, after one warm-up call."""
    call()
    sync()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    mine = np.array([(time.perf_counter() - start) / iters])
    slowest = np.empty(1)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    return float(slowest[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", default="8")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--factor", type=int, default=4, help="size step (nccl-tests -f)")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    p.add_argument("--comm", default="mpi", choices=["mpi", "nccl"])
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    backend = select_backend(args.backend, rank)
    hp = create_communicator(comm, args.comm, backend, name="bench", check=False)  # as the jobs
    raw_ok = not backend.is_gpu  # raw mpi4py baseline uses host arrays
    sizes, s = [], parse_size(args.min_bytes)
    while s < parse_size(args.max_bytes):
        sizes.append(s)
        s *= args.factor
    sizes.append(parse_size(args.max_bytes))

    if rank == 0:
        print(f"# hpcpar {hp.kind} communicator vs raw mpi4py, {n} ranks, float32, "
              f"{backend.name} arrays; {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'op':>15} {'bytes':>10} {'time us':>10} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11} {'raw us':>10} {'ratio':>6}")
    for op in args.ops.split(","):
        for nbytes in sizes:
            iters = max(3, min(200, (32 << 20) // nbytes))
            ours, raw = make_calls(op, comm, hp, nbytes, backend.xp)
            t = timed(comm, ours, iters, backend.synchronize)
            t_raw = timed(comm, raw, iters, backend.synchronize) if raw_ok else float("nan")
            if rank == 0:
                algbw = nbytes / t / 1e9
                print(f"{op:>15} {nbytes:>10} {t * 1e6:>10.1f} {algbw:>11.3f} "
                      f"{algbw * busbw_factor(op, n):>11.3f} {t_raw * 1e6:>10.1f} "
                      f"{t / t_raw:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
