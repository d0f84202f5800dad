"""One distributed array taken through every pair of placements on a 2 x 2 mesh.

    mpiexec -n 4 python examples/redistribute.py

A 6 x 8 array is placed every way a mesh axis can hold it (replicated, a pending sum,
sharded along either dimension, unevenly by given sizes, by whole units of 4 columns), on
each of the two axes, and redistributed to every other such placement. Each result's
``full()`` equals the array; rank 0 prints the steps of a few redistributions and how many
pairs ran. Placements whose pieces do not split (6 rows cut by both axes: 3 rows over 2
ranks, no sizes given) are refused with a ``ShardingError``, the same on every rank, and
counted.
"""

import itertools

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

PLACEMENTS = [hp.Replicate(), hp.Partial(), hp.Shard(0), hp.Shard(1),
              hp.Shard(0, sizes=(4, 2)), hp.Shard(1, unit=4)]


def main():
    mesh = hp.Mesh(MPI.COMM_WORLD, {"x": 2, "y": 2})
    full = np.arange(48, dtype=np.float64).reshape(6, 8)
    pairs = refused = 0
    layouts = list(itertools.product(PLACEMENTS, repeat=2))
    for src in layouts:
        try:
            x = hp.DArray.from_full(full, mesh, list(src))
        except hp.tensor.ShardingError:
            refused += 1
            continue
        for dst in layouts:
            try:
                y = x.redistribute(list(dst))
            except hp.tensor.ShardingError:
                continue
            assert np.array_equal(y.full(), full), (src, dst)
            assert np.array_equal(x.full(), full)       # the source is left as it was
            pairs += 1
    if mesh.rank == 0:
        for src, dst in [((hp.Shard(0), hp.Replicate()), (hp.Shard(1), hp.Replicate())),
                         ((hp.Partial(), hp.Replicate()), (hp.Shard(0), hp.Replicate())),
                         ((hp.Shard(0), hp.Shard(0)), (hp.Replicate(), hp.Shard(0)))]:
            steps = hp.tensor.redistribution_steps(full.shape, mesh.sizes, src, dst)
            print(f"{src} -> {dst}:", "; ".join(s.text(mesh.axis_names) for s in steps))
        print(f"{pairs} pairs of the {len(layouts) - refused} placements that split the "
              f"array ({refused} refused), every one equal to the array: OK")


if __name__ == "__main__":
    main()
