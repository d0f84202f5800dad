"""hpcpar.parallel against what its users would otherwise write, in one run: torch's DTensor
(``torch.distributed`` over gloo, CPU) and the same work written by hand with mpi4py.

    mpiexec -n 2 python benchmarks/library.py
    mpiexec -n 4 python benchmarks/library.py [--sizes 64K,1M,16M,64M] [--repeat 5]
                                              [--matmul-sizes 64K,1M,16M] [--json FILE]

Two kinds of work on float32 square arrays of the given global size:
- **redistribution** over a 1-D mesh of every rank: each ordered pair of Shard(0), Shard(1),
  Replicate() and Partial() (an all-gather, all-reduce, reduce-scatter, all-to-all, or a
  local slice or zero-fill), ``DArray.redistribute`` against ``DTensor.redistribute``;
- **sharded matmul** Y = A B (A, B and Y of that size) under each policy, placed as the
  policy takes them, Y returned where the policy leaves it (``inner``, ``inner_gather`` and
  ``outer`` as a replicated Y, so DTensor's result is redistributed to Replicate too).

Four columns per case, each the fastest of ``--repeat`` runs from a barrier to the next
(until every rank has its result), the implementations taken in a rotating order:
- hpcpar: the library call, agreement checks on (a ``Mesh`` checks by default);
- DTensor: the same placements in ``torch.distributed.tensor`` (gloo has no all-to-all on
  the CPU: DTensor falls back to an all-gather and a slice there);
- by hand: the same result written with mpi4py buffer calls and NumPy, as fast as we know
  how: the collective into a new array plus the packing or unpacking the layouts need;
- unchecked: the library call on a ``Mesh(check=False)`` (redistribution only), which
  leaves out the agreement check's small all-reduce: what the check costs;
- MPI alone: the bare collective on preallocated contiguous buffers of the same counts (a
  floor no redistribution that returns a new array in another layout reaches).
Ratios are the other's time over hpcpar's (above 1: hpcpar is faster). One BLAS thread per
rank for NumPy and torch alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

PLACEMENTS = ("S0", "S1", "R", "P")
COLLECTIVE = {("S0", "R"): "all-gather", ("S1", "R"): "all-gather", ("P", "R"): "all-reduce",
              ("P", "S0"): "reduce-scatter", ("P", "S1"): "reduce-scatter",
              ("S0", "S1"): "all-to-all", ("S1", "S0"): "all-to-all"}
POLICIES = ("duplicated", "local", "inner", "inner_gather", "outer", "full")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def side(nbytes: int, p: int) -> int:
    """The side of a float32 square array of about ``nbytes``, a multiple of p."""
    return max(p, round((nbytes / 4) ** 0.5 / p) * p)


class Timer:
    """The fastest of several runs of each implementation, each run timed from a barrier to
    the barrier after it (until every rank has its result: with more ranks than cores, a
    rank's own clock would leave out the time it waited for a core), the implementations
    taken in a rotating order so that neither drift nor the one before favours any."""

    def __init__(self, comm, repeat: int, left_out: set = frozenset()):
        self.comm, self.repeat, self.left_out = comm, repeat, left_out

    def best(self, calls: dict) -> dict:
        calls = {k: v for k, v in calls.items() if k not in self.left_out}
        for fn in calls.values():                # warm-up: allocations, programs, caches
            fn()
        names = list(calls)
        times = {name: [] for name in names}
        for rep in range(self.repeat):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                self.comm.Barrier()
                start = time.perf_counter()
                calls[name]()
                self.comm.Barrier()
                times[name].append(time.perf_counter() - start)
        return {name: 1e3 * self.comm.allreduce(min(ts), op=MPI.MAX)
                for name, ts in times.items()}


# ---- redistribution -------------------------------------------------------------------------

def hp_placement(name: str):
    return {"S0": hp.Shard(0), "S1": hp.Shard(1), "R": hp.Replicate(), "P": hp.Partial()}[name]


def torch_placement(name: str):
    from torch.distributed.tensor import Partial, Replicate, Shard
    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}[name]


def by_hand(comm, src: str, dst: str, local: np.ndarray, n: int):
    """The redistribution written with mpi4py and NumPy: a function returning the new local
    array, and the bare collective on preallocated buffers (None when there is none)."""
    p, r = comm.Get_size(), comm.Get_rank()
    k = n // p
    rows, cols = slice(r * k, (r + 1) * k), (slice(None), slice(r * k, (r + 1) * k))
    out_like = {"S0": (k, n), "S1": (n, k), "R": (n, n), "P": (n, n)}

    def gather_rows():                                      # S0 -> R
        out = np.empty((n, n), np.float32)
        comm.Allgather(local, out)
        return out

    def gather_cols():                                      # S1 -> R: (p, n, k) -> (n, n)
        buf = np.empty((p, n, k), np.float32)
        comm.Allgather(local, buf)
        return buf.transpose(1, 0, 2).reshape(n, n)

    def rows_to_cols():                                     # S0 -> S1: pack, exchange
        send = np.ascontiguousarray(local.reshape(k, p, k).transpose(1, 0, 2))
        out = np.empty((n, k), np.float32)
        comm.Alltoall(send, out)
        return out

    def cols_to_rows():                                     # S1 -> S0: exchange, unpack
        recv = np.empty((p, k, k), np.float32)
        comm.Alltoall(local, recv)
        return recv.transpose(1, 0, 2).reshape(k, n)

    def reduce_all():
        out = np.empty_like(local)
        comm.Allreduce(local, out)
        return out

    def reduce_rows():
        out = np.empty((k, n), np.float32)
        comm.Reduce_scatter_block(local, out)
        return out

    def reduce_cols():
        send = np.ascontiguousarray(local.reshape(n, p, k).transpose(1, 0, 2))
        out = np.empty((n, k), np.float32)
        comm.Reduce_scatter_block(send, out)
        return out

    def zero_pad(where):
        def run():
            out = np.zeros((n, n), np.float32)
            out[where] = local
            return out
        return run

    work = {("S0", "R"): gather_rows, ("S1", "R"): gather_cols, ("S0", "S1"): rows_to_cols,
            ("S1", "S0"): cols_to_rows, ("P", "R"): reduce_all, ("P", "S0"): reduce_rows,
            ("P", "S1"): reduce_cols, ("R", "S0"): lambda: local[rows].copy(),
            ("R", "S1"): lambda: local[cols].copy(), ("S0", "P"): zero_pad(rows),
            ("S1", "P"): zero_pad(cols),
            ("R", "P"): lambda: local.copy() if r == 0 else np.zeros_like(local)}[(src, dst)]
    kind = COLLECTIVE.get((src, dst))
    if kind is None:
        return work, None
    send = np.ascontiguousarray(local).reshape(-1)
    recv = np.empty(int(np.prod(out_like[dst])) if kind != "all-to-all" else send.size,
                    np.float32)
    bare = {"all-gather": lambda: comm.Allgather(send, recv),
            "all-reduce": lambda: comm.Allreduce(send, recv),
            "reduce-scatter": lambda: comm.Reduce_scatter_block(send, recv),
            "all-to-all": lambda: comm.Alltoall(send, recv)}[kind]
    return work, bare


def redistributions(comm, timer, mesh, quiet, device_mesh, sizes) -> list[dict]:
    """Every ordered pair of placements at every size (``quiet``: a mesh that does not
    check)."""
    from torch.distributed.tensor import DTensor
    import torch
    p = comm.Get_size()
    out = []
    for nbytes in sizes:
        n = side(nbytes, p)
        full = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
        for src in PLACEMENTS:
            x = hp.DArray.from_full(full, mesh, [hp_placement(src)])
            x_quiet = hp.DArray.from_full(full, quiet, [hp_placement(src)])
            dt = DTensor.from_local(torch.from_numpy(x.local.copy()), device_mesh,
                                    [torch_placement(src)], run_check=False,
                                    shape=torch.Size((n, n)), stride=(n, 1))
            for dst in PLACEMENTS:
                if dst == src:
                    continue
                work, bare = by_hand(comm, src, dst, x.local, n)
                # the targets made once, as a loop would (each side's constructors untimed)
                target, torch_target = [hp_placement(dst)], [torch_placement(dst)]
                assert np.array_equal(work(), x.redistribute(target).local)
                calls = {"hpcpar": lambda: x.redistribute(target),
                         "DTensor": lambda: _wait(dt.redistribute(device_mesh, torch_target)),
                         "by hand": work, "unchecked": lambda: x_quiet.redistribute(target)}
                if dst == "P":          # DTensor: "redistributing to Partial is for internal
                    del calls["DTensor"]                                     # use only"
                if bare is not None:
                    calls["MPI alone"] = bare
                row = {"work": "redistribute", "case": f"{src}->{dst}",
                       "collective": COLLECTIVE.get((src, dst), "local"), "ranks": p,
                       "bytes": 4 * n * n} | timer.best(calls)
                out.append(row)
                report(comm, row)
    return out


def _wait(dt):
    local = dt.to_local()
    return local.wait() if hasattr(local, "wait") else local


# ---- sharded matmul -------------------------------------------------------------------------

def matmul_cases(p: int) -> list[tuple]:
    """(policy, mesh axes, A's placements, B's, Y's as hpcpar leaves it) per policy."""
    S0, S1, R = "S0", "S1", "R"
    cases = [("duplicated", {"x": p}, [R], [R]), ("local", {"x": p}, [S0], [R]),
             ("inner", {"x": p}, [S1], [S0]), ("inner_gather", {"x": p}, [S1], [S1]),
             ("outer", {"x": p}, [S0], [S0])]
    if p == 4:
        cases.append(("full", {"r": 2, "c": 2}, [S0, S1], [S0, S1]))
    return cases


def by_hand_matmul(comm, policy, a_local, b_local, a_full, b_full, sub):
    """The policy written with mpi4py and NumPy, returning Y placed as hpcpar returns it."""
    p = comm.Get_size()

    def gather(x, axis, group=comm):
        q = group.Get_size()
        buf = np.empty((q,) + x.shape, x.dtype)
        group.Allgather(np.ascontiguousarray(x), buf)
        return np.concatenate(list(buf), axis=axis)

    if policy == "duplicated" or policy == "local":
        return lambda: a_local @ b_local
    if policy == "inner":
        def inner():
            y = a_local @ b_local
            comm.Allreduce(MPI.IN_PLACE, y)
            return y
        return inner
    if policy == "inner_gather":                # A's k gathered, B's columns: Y's gathered
        return lambda: gather(gather(a_local, 1) @ b_local, 1)
    if policy == "outer":
        return lambda: gather(a_local @ gather(b_local, 0), 0)
    rows, cols = sub                                       # full: a 2 x 2 mesh
    return lambda: gather(a_local, 1, cols) @ gather(b_local, 0, rows)
    del p


def matmuls(comm, timer, device_mesh_of, sizes) -> list[dict]:
    import torch
    from torch.distributed.tensor import DTensor
    p = comm.Get_size()
    out = []
    for nbytes in sizes:
        n = side(nbytes, p)
        rng = np.random.default_rng(1)
        a_full, b_full = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
        for policy, axes, a_pl, b_pl in matmul_cases(p):
            mesh = hp.Mesh(comm, axes)
            a = hp.DArray.from_full(a_full, mesh, [hp_placement(q) for q in a_pl])
            b = hp.DArray.from_full(b_full, mesh, [hp_placement(q) for q in b_pl])
            y = hp.matmul(a, b, policy=policy)
            dmesh = device_mesh_of(tuple(axes.values()))
            da, db = (DTensor.from_local(torch.from_numpy(t.local.copy()), dmesh,
                                         [torch_placement(q) for q in pl], run_check=False,
                                         shape=torch.Size(t.shape), stride=(t.shape[1], 1))
                      for t, pl in ((a, a_pl), (b, b_pl)))
            y_pl = [torch_placement("R" if isinstance(q, hp.Replicate) else
                                    f"S{q.dim}") for q in y.placements]
            sub = (mesh.group("r").mpi_comm, mesh.group("c").mpi_comm) if policy == "full" \
                else None
            hand = by_hand_matmul(comm, policy, a.local, b.local, a_full, b_full, sub)
            np.testing.assert_allclose(hand(), y.local, rtol=2e-4, atol=2e-3)
            calls = {"hpcpar": lambda: hp.matmul(a, b, policy=policy),
                     "DTensor": lambda: _wait(torch.mm(da, db).redistribute(dmesh, y_pl)),
                     "by hand": hand}
            row = {"work": "matmul", "case": policy, "collective": "", "ranks": p,
                   "bytes": 4 * n * n} | timer.best(calls)
            out.append(row)
            report(comm, row)
            mesh.free()
    return out


# ---- output ---------------------------------------------------------------------------------

def ratio(row: dict, other: str) -> str:
    return f"{row[other] / row['hpcpar']:.2f}x" if row.get(other) else ""


def report(comm, row: dict) -> None:
    if comm.Get_rank() != 0:
        return
    size = row["bytes"]
    text = f"{size / (1 << 20):.2f} MB" if size >= 1 << 20 else f"{size >> 10} KB"
    cells = [row["work"], row["case"], row["collective"], str(row["ranks"]), text]
    cells += [f"{row[k]:.3f}" if row.get(k) else "" for k in ("hpcpar", "DTensor", "by hand",
                                                              "MPI alone", "unchecked")]
    cells += [ratio(row, "DTensor"), ratio(row, "by hand"), ratio(row, "MPI alone")]
    cells += [f"{row['by hand'] / row['unchecked']:.2f}x" if row.get("unchecked") else ""]
    print("| " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,1M,16M,64M")
    parser.add_argument("--matmul-sizes", default="64K,1M,16M,64M")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--without", default="", help="implementations to leave out, e.g. "
                        "DTensor (its gloo threads share the cores with the others)")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0
                                               else None))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    meshes = {}

    def device_mesh_of(shape):
        if shape not in meshes:
            meshes[shape] = init_device_mesh("cpu", shape)
        return meshes[shape]

    timer = Timer(comm, args.repeat, set(args.without.split(",")) - {""})
    if comm.rank == 0:
        print("| work | case | collective | ranks | size | hpcpar ms | DTensor ms | by hand ms "
              "| MPI alone ms | unchecked ms | vs DTensor | vs by hand | vs MPI alone "
              "| unchecked vs by hand |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    mesh = hp.Mesh(comm, {"x": comm.Get_size()})
    quiet = hp.Mesh(comm, {"x": comm.Get_size()}, check=False)
    rows = redistributions(comm, timer, mesh, quiet, device_mesh_of((comm.Get_size(),)),
                           [parse_size(s) for s in args.sizes.split(",") if s])
    rows += matmuls(comm, Timer(comm, max(2, args.repeat // 2), timer.left_out), device_mesh_of,
                    [parse_size(s) for s in args.matmul_sizes.split(",") if s])
    if comm.rank == 0 and args.json:
        args.json.write_text(json.dumps({"machine": platform.node(), "cores": os.cpu_count(),
                                         "ranks": comm.Get_size(), "rows": rows}, indent=1))
    mesh.free()
    quiet.free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
