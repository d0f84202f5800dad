"""The parallel core's pure parts, without MPI: split rules, mesh coordinates, redistribution
steps, matmul policy choice on a one-rank mesh, micro-batch split, and the errors of bad input.
The multi-rank behaviour is in test_parallel_mpi.py."""

import numpy as np
import pytest

from hpcpar.parallel.device.dtypes import bfloat16
from hpcpar.parallel.tensor import splits
from hpcpar.parallel.mesh import MeshError, group_members, mesh_coords, mesh_rank, resolve_shape
from hpcpar.parallel.tensor.placement import Partial, Replicate, Shard
from hpcpar.parallel.tensor.redistribute import redistribution_steps as steps_of

R, P = Replicate(), Partial()


def test_bounds_even_uneven_and_by_units():
    assert splits.bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert splits.bounds(7, 3, sizes=[3, 2, 2]) == [(0, 3), (3, 5), (5, 7)]
    assert splits.bounds(12, 2, unit=3) == [(0, 6), (6, 12)]               # 2 heads each
    # 2 KV heads of 4 over 8 ranks: each head on 4 consecutive ranks (GQA)
    assert splits.bounds(8, 8, unit=4) == [(0, 4)] * 4 + [(4, 8)] * 4
    assert splits.unit_replicas(8, 8, unit=4) == 4
    assert splits.even_sizes(10, 4) == [3, 3, 2, 2]


def test_bounds_refuse_what_does_not_split_with_the_numbers():
    with pytest.raises(splits.ShardingError, match=r"length 10 does not split evenly over 4 "
                                                   r"ranks; pass sizes=\[3, 3, 2, 2\]"):
        splits.bounds(10, 4)
    with pytest.raises(splits.ShardingError, match="adding up to 10"):
        splits.bounds(10, 2, sizes=[4, 5])
    with pytest.raises(splits.ShardingError, match="3 units of 4"):
        splits.bounds(12, 2, unit=4)
    assert splits.unit_split_problem(3, 2) == "3 is neither a multiple nor a divisor of 2"
    assert splits.unit_split_problem(2, 8) is None
    assert splits.unit_split_problem(2, 8, replicate=False) == "2 is not divisible by 8"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.float64, np.int64,
                                   np.int32])
@pytest.mark.parametrize("axis,parts,sizes,unit", [(0, 3, None, 1), (1, 2, [5, 1], 1),
                                                   (1, 3, None, 2), (0, 4, [0, 2, 3, 1], 1)])
def test_split_and_merge_are_inverses(dtype, axis, parts, sizes, unit):
    full = (np.arange(6 * 6).reshape(6, 6) % 17).astype(dtype)
    pieces = splits.split(full, axis, parts, sizes, unit)
    assert sum(p.shape[axis] for p in pieces) == 6
    assert all(p.dtype == np.dtype(dtype) for p in pieces)
    np.testing.assert_array_equal(splits.merge(pieces, axis, sizes, unit), full)


def test_merge_of_replicated_units_needs_the_length():
    full = np.arange(8.0).reshape(1, 8)
    pieces = splits.split(full, 1, 4, unit=4)          # 2 units over 4 ranks
    assert [p[0, 0] for p in pieces] == [0, 0, 4, 4]
    np.testing.assert_array_equal(splits.merge(pieces, 1, unit=4, length=8), full)


def test_vocab_range_pads_the_last_blocks():
    assert [splits.vocab_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9),
                                                                (9, 10)]
    assert splits.padded_vocab_size(10, 4) == 12


@pytest.mark.parametrize("rows,parts", [(11, 4), (10, 4), (5, 8), (8, 2)])
def test_a_padded_shard_cuts_blocks_of_ceil_n_over_p_each_padded_to_one_shape(rows, parts):
    """The vocabulary's split, as a placement: every rank's buffer is the same shape, its
    rows the whole tensor's in blocks of ceil(n / p), zero past the end (NumPy's reference:
    the tensor padded with zero rows, cut evenly)."""
    full = np.arange(1, rows * 3 + 1).reshape(rows, 3)
    per = -(-rows // parts)
    padded = np.zeros((per * parts, 3), dtype=full.dtype)
    padded[:rows] = full
    for r in range(parts):
        piece = Shard(0, padded=True).piece(full.shape, r, parts)
        local = np.zeros(piece.shape, dtype=full.dtype)
        local[piece.dest] = full[piece.source]
        np.testing.assert_array_equal(local, padded[r * per:(r + 1) * per])
    whole = Replicate().piece(full.shape, 1, parts)
    assert whole.shape == full.shape and np.array_equal(full[whole.source], full)
    with pytest.raises(splits.ShardingError, match="neither sizes nor a unit"):
        Shard(0, sizes=(1, 2), padded=True)


def test_mesh_coordinates_and_groups_are_row_major():
    sizes = (2, 2, 2)                                   # dp, pp, tp
    assert [mesh_coords(r, sizes) for r in (0, 1, 2, 5)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0),
                                                             (1, 0, 1)]
    assert all(mesh_rank(mesh_coords(r, sizes), sizes) == r for r in range(8))
    assert group_members(5, sizes, (2,)) == [4, 5]                 # tp
    assert group_members(5, sizes, (0,)) == [1, 5]                 # dp
    assert group_members(5, sizes, (1, 2)) == [4, 5, 6, 7]         # pp x tp


def test_mesh_shape_errors_give_the_numbers():
    assert resolve_shape({"dp": -1, "tp": 2}, 8) == {"dp": 4, "tp": 2}
    with pytest.raises(MeshError, match=r"dp\(2\) \* pp\(2\) \* tp\(4\) = 16 != world size 8"):
        resolve_shape({"dp": 2, "pp": 2, "tp": 4}, 8)
    with pytest.raises(MeshError, match="do not divide"):
        resolve_shape({"x": -1, "y": 3}, 8)
    with pytest.raises(MeshError, match="at most one -1"):
        resolve_shape({"x": -1, "y": -1}, 8)


def _ops(steps):
    return [(s.axis, s.op) for s in steps]


def test_redistribution_steps_use_the_fewest_collectives():
    shape = (8, 8)
    assert _ops(steps_of(shape, (2,), [Shard(0)], [R])) == [(0, "all_gather")]
    assert _ops(steps_of(shape, (2,), [P], [R])) == [(0, "all_reduce")]
    assert _ops(steps_of(shape, (2,), [P], [Shard(1)])) == [(0, "reduce_scatter")]
    assert _ops(steps_of(shape, (2,), [Shard(0)], [Shard(1)])) == [(0, "all_to_all")]
    assert _ops(steps_of(shape, (2,), [R], [Shard(0)])) == [(0, "slice")]
    assert _ops(steps_of(shape, (2,), [Shard(0)], [P])) == [(0, "zero_pad")]
    assert _ops(steps_of(shape, (2,), [R], [P])) == [(0, "keep_one")]
    assert steps_of(shape, (2, 2), [Shard(0), Shard(1)], [Shard(0), Shard(1)]) == []
    # unchanged outer shard, inner one changes: only the inner axis moves
    assert _ops(steps_of(shape, (2, 2), [Shard(0), Shard(0)], [Shard(0), R])) == [
        (1, "all_gather")]
    # the outer shard of a doubly-sharded dim changes: inner first, then cut again
    assert _ops(steps_of(shape, (2, 2), [Shard(0), Shard(0)], [R, Shard(0)])) == [
        (1, "all_gather"), (0, "all_gather"), (1, "slice")]
    # replicated units cannot be summed as a partition: through Replicate instead
    assert _ops(steps_of((8, 8), (4,), [Shard(1, unit=4)], [P])) == [(0, "all_gather"),
                                                               (0, "keep_one")]


def test_redistribution_steps_take_lists_in_axis_order_and_say_how_to_make_one():
    from hpcpar.parallel.tensor import PlacementError
    with pytest.raises(PlacementError, match=r"one placement per mesh axis, in order \(2\).*"
                                             r"for name in mesh.axis_names"):
        steps_of((8, 8), (2, 2), {"dp": Shard(0)}, [R, R])
    given, axis_names = {"tp": Shard(1)}, ("dp", "tp")
    listed = [given.get(name, R) for name in axis_names]
    assert [s.text(axis_names) for s in steps_of((8, 8), (2, 2), [R, R], listed)] == [
        "slice over 'tp': Replicate() -> Shard(1)"]


def test_placements_read_as_they_are_written():
    assert repr(Shard(1, sizes=[3, 2])) == "Shard(1, sizes=(3, 2))"
    assert repr(Shard(0, unit=64)) == "Shard(0, unit=64)"
    assert repr(Shard(0, padded=True)) == "Shard(0, padded=True)"
    assert (repr(R), repr(P)) == ("Replicate()", "Partial()")
    assert Shard(0) == Shard(0) and Shard(0) != Shard(0, sizes=(1, 1))


def test_one_rank_mesh_runs_every_policy_locally():
    import hpcpar.parallel as hp
    from mpi4py import MPI
    mesh = hp.Mesh(MPI.COMM_SELF, {"x": 1})
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 5)), rng.standard_normal((5, 2))
    for policy in ("duplicated", "inner", "inner_gather", "outer"):
        y = hp.matmul(hp.DArray.from_full(a, mesh, {}), hp.DArray.from_full(b, mesh, {}),
                      policy=policy)
        np.testing.assert_allclose(y.full(), a @ b, rtol=1e-12)


def test_bad_operands_are_one_clear_error():
    import hpcpar.parallel as hp
    from mpi4py import MPI
    mesh, other = hp.Mesh(MPI.COMM_SELF, {"x": 1}), hp.Mesh(MPI.COMM_SELF, {"x": 1})
    a = hp.DArray.from_full(np.ones((2, 3)), mesh, {})
    with pytest.raises(hp.tensor.PolicyError, match="different meshes"):
        hp.matmul(a, hp.DArray.from_full(np.ones((3, 2)), other, {}))
    with pytest.raises(hp.tensor.PolicyError, match=r"do not share the inner dimension \(3 != 4\)"):
        hp.matmul(a, hp.DArray.from_full(np.ones((4, 2)), mesh, {}))
    with pytest.raises(hp.tensor.PolicyError, match="not one of"):
        hp.matmul(a, hp.DArray.from_full(np.ones((3, 2)), mesh, {}), policy="diagonal")
    with pytest.raises(hp.tensor.PlacementError, match="no dimension 2"):
        hp.DArray.from_full(np.ones((2, 3)), mesh, {"x": hp.Shard(2)})
    with pytest.raises(hp.mesh.MeshError, match="not 'y'"):
        hp.DArray.from_full(np.ones((2, 3)), mesh, {"y": hp.Shard(0)})
    with pytest.raises(hp.tensor.PlacementError, match="a padded shard is a vocabulary-"):
        hp.DArray.from_full(np.ones((2, 3)), mesh, {"x": hp.Shard(0, padded=True)})


def test_16_bit_operands_take_every_activation_and_the_embedding_takes_integer_ids():
    """FeedForward on bfloat16 operands computes silu and gelu_tanh in float32 and hands
    the next product bfloat16 (it refused them, blaming the operands' dtypes); an embedding
    given float ids refuses them (NumPy raised an IndexError)."""
    import hpcpar.parallel as hp
    from mpi4py import MPI
    mesh = hp.Mesh(MPI.COMM_SELF, {"tp": 1})
    rng = np.random.default_rng(0)
    w1, w2, x = (rng.standard_normal(s) for s in [(4, 8), (8, 4), (3, 4)])
    for activation in ("relu", "silu", "gelu_tanh"):
        f, _ = hp.tensor.ACTIVATIONS[activation]
        want = f(np, x.astype(bfloat16).astype(np.float64) @ w1.astype(bfloat16)
                 .astype(np.float64)) @ w2.astype(bfloat16).astype(np.float64)
        ffn = hp.tensor.FeedForward(*(hp.DArray.from_full(w.astype(bfloat16), mesh, {"tp": pl})
                               for w, pl in ((w1, hp.Shard(1)), (w2, hp.Shard(0)))),
                             activation=activation)
        y, ctx = ffn.forward(hp.DArray.from_full(x.astype(bfloat16), mesh, {}))
        assert y.dtype == bfloat16
        got = y.full().astype(np.float64)
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want), activation
        dx, dw1, dw2 = ffn.backward(y.like(np.ones_like(y.local)), ctx)
        assert dx.dtype == dw1.dtype == dw2.dtype == bfloat16
    embedding = hp.VocabParallelEmbedding.from_full(mesh.group("tp"), np.ones((10, 4)))
    with pytest.raises(hp.HpcparError, match="token ids are integers"):
        embedding.forward(np.array([[1.5, 2.0]]))


def test_a_stage_of_functions_lists_the_parameters_it_is_given():
    import hpcpar.parallel as hp
    w, b = hp.Parameter(np.ones((2, 2))), hp.Parameter(np.zeros(2))

    def forward(x):
        return x @ w.data.T + b.data, x

    assert hp.named_parameters(hp.Stage(forward, None)) == {}      # closures: not searched
    assert hp.named_parameters(hp.Stage(forward, None, params=[w, b]), "s") == {"s.0": w,
                                                                             "s.1": b}
    assert hp.named_parameters(hp.Stage(forward, None, params={"w": w})) == {"w": w}


def test_micro_batches_split_and_join():
    import hpcpar.parallel as hp
    x = np.arange(20).reshape(10, 2)
    parts = hp.split_micro_batches(x, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    np.testing.assert_array_equal(hp.pipeline.concat_micro_batches(parts), x)
    with pytest.raises(hp.HpcparError, match="cannot cut 10 rows into 11"):
        hp.split_micro_batches(x, 11)


@pytest.mark.gpu
def test_the_core_on_cupy_arrays():
    """One rank on a GPU: distributed arrays, a policy's product and backward, the layers and
    a pipeline step keep CuPy arrays on the device and equal NumPy's (not yet run on a GPU)."""
    from mpi4py import MPI

    import hpcpar.parallel as hp
    from hpcpar.parallel.device.backend import select_backend
    backend = select_backend("cupy")
    mesh = hp.Mesh(MPI.COMM_SELF, {"x": 1}, backend=backend)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(
        np.float32)
    y, ctx = hp.tensor.matmul_forward(hp.DArray.from_full(a, mesh, [hp.Shard(1)]),
                               hp.DArray.from_full(b, mesh, [hp.Shard(0)]))
    assert type(y.local).__module__.startswith("cupy")
    np.testing.assert_allclose(backend.to_host(y.full()), a @ b, rtol=1e-5)
    da, _ = hp.tensor.matmul_backward(y.like(y.local * 0 + 1), ctx)
    np.testing.assert_allclose(backend.to_host(da.full()), np.ones((6, 3)) @ b.T, rtol=1e-5)
    tp = mesh.group("x")
    col = hp.ColumnParallelLinear.from_full(tp, a.T.copy())
    z, _ = col.forward(backend.asarray(rng.standard_normal((2, 6)).astype(np.float32)))
    assert type(z).__module__.startswith("cupy")


@pytest.mark.slow
def test_every_public_name_resolves_and_the_pure_modules_stay_free_of_mpi():
    """``hpcpar.parallel`` loads its names on first use: each exported name is the object
    documented (not a submodule of the same name), and importing the split rules, as the
    configuration does, starts no MPI."""
    import pkgutil
    import subprocess
    import sys
    import types

    import hpcpar.parallel as hp
    for name in hp.__all__:
        assert not isinstance(getattr(hp, name), types.ModuleType), name
    assert not {m.name for m in pkgutil.iter_modules(hp.__path__)} & set(hp.__all__)
    probe = ("import sys, hpcpar.models.config, hpcpar.models.sharding, "
             "hpcpar.parallel.tensor.splits; print('mpi4py.MPI' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
