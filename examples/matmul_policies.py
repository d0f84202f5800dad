"""Every sharded-matmul policy on a 2 x 2 mesh, against the dense product.

    mpiexec -n 4 python examples/matmul_policies.py

A (m, k) and B (k, n) are placed on a mesh of axes "r" and "c" as each policy takes them;
``hp.matmul`` finds the policy from the placements, runs its collectives, and the result
(gathered with ``full()``) equals A @ B. The backward gives dA and dB in the operands' own
placements. Printed on rank 0: each policy, its collectives and the largest error.
"""

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

S0, S1, R = hp.Shard(0), hp.Shard(1), hp.Replicate()

# (A's placements, B's placements) by mesh axis, one entry per policy
CASES = {
    "duplicated": ({}, {}),
    "inner": ({"r": S1}, {"r": S0}),                  # k split the same way: AllReduce
    "inner_gather": ({"c": S1}, {"c": S1}),           # k of A, n of B: AllGather A first
    "outer": ({"r": S0}, {"r": S0}),                  # m of A and k of B: AllGather twice
    "full": ({"r": S0, "c": S1}, {"r": S0, "c": S1}),  # m, k and n split: one block each
    "local": ({"r": S0}, {"c": S1}),                  # rows of A x columns of B: nothing
}


def main():
    mesh = hp.Mesh(MPI.COMM_WORLD, {"r": 2, "c": 2})
    rng = np.random.default_rng(0)                    # the same dense arrays on every rank
    a_full, b_full = rng.standard_normal((6, 10)), rng.standard_normal((10, 4))
    dy_full = rng.standard_normal((6, 4))
    for name, (pa, pb) in CASES.items():
        a = hp.DArray.from_full(a_full, mesh, pa)
        b = hp.DArray.from_full(b_full, mesh, pb)
        y, ctx = hp.tensor.matmul_forward(a, b)
        assert ctx.policy == name, (ctx.policy, name)
        da, db = hp.tensor.matmul_backward(hp.DArray.from_full(dy_full, mesh, y.placements), ctx)
        error = max(np.abs(y.full() - a_full @ b_full).max(),
                    np.abs(da.full() - dy_full @ b_full.T).max(),
                    np.abs(db.full() - a_full.T @ dy_full).max())
        assert error < 1e-12, (name, error)
        steps = hp.tensor.matmul_communication(a, b) or ["no communication"]
        if mesh.rank == 0:
            print(f"{name:13s} Y {y.placement_text():35s} max error {error:.1e}")
            for s in steps:
                print(f"{'':16s}{s}")
    # an explicit policy redistributes the operands it is given
    a = hp.DArray.from_full(a_full, mesh, {})
    b = hp.DArray.from_full(b_full, mesh, {})
    y = hp.matmul(a, b, policy="full", axis=("r", "c"))
    assert np.allclose(y.full(), a_full @ b_full)
    if mesh.rank == 0:
        print(f"explicit 'full' on replicated operands: Y {y.placement_text()}: OK")


if __name__ == "__main__":
    main()
