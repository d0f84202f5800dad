"""Every collective against NumPy, on 2 ranks (a pair) and 8 (blocks of no rows, sizes no
rank count divides)."""

import numpy as np
import pytest

from hpcpar.parallel.comm import CommStats, MpiCommunicator, split_sizes
from hpcpar.parallel.device.dtypes import bfloat16
from hpcpar.parallel.errors import HpcparError

DTYPES = [np.float32, np.float16, bfloat16, np.float64, np.int64]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 5)]


def _data(rank: int, shape, dtype, salt: int = 0) -> np.ndarray:
    """Rank-specific values that are exact in every dtype (small integers, or halves)."""
    rng = np.random.default_rng(1000 * rank + salt)
    return (rng.integers(-8, 8, size=shape) / 2).astype(dtype)


def _as64(a):
    return np.asarray(a).astype(np.float64)


@pytest.fixture
def world(comm):
    return MpiCommunicator(comm, stats=CommStats())


def test_split_sizes_put_the_remainder_first():
    assert split_sizes(7, 3) == [3, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    assert sum(split_sizes(1000, 7)) == 1000


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_all_reduce_sums_in_place(world, dtype, shape):
    x = _data(world.rank, shape, dtype)
    expected = sum(_as64(_data(r, shape, dtype)) for r in range(world.size))
    out = world.all_reduce(x)
    assert out is x and x.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(_as64(x), expected)


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", [((3,), 0), ((3, 5), 0), ((3, 5), 1), ((2, 3, 5), 1),
                                         ((2, 3, 5), -1)])
def test_all_gather_concatenates_in_rank_order(world, dtype, shape, axis):
    x = _data(world.rank, shape, dtype)
    expected = np.concatenate([_data(r, shape, dtype) for r in range(world.size)], axis=axis)
    got = world.all_gather(x, axis=axis)
    assert got.dtype == np.dtype(dtype) and got.flags.c_contiguous
    np.testing.assert_array_equal(_as64(got), _as64(expected))


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.int64])
def test_all_gather_of_uneven_blocks(world, dtype):
    sizes = [r % 3 + 1 for r in range(world.size)]
    block = lambda r: _data(r, (4, sizes[r]), dtype)  # noqa: E731
    got = world.all_gather(block(world.rank), axis=1, sizes=sizes)
    expected = np.concatenate([block(r) for r in range(world.size)], axis=1)
    np.testing.assert_array_equal(_as64(got), _as64(expected))


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, axis", [(None, 0), (None, 1), (7, 0), (5, 1), (1, 0)])
def test_reduce_scatter_keeps_this_ranks_block_of_the_sum(world, dtype, n, axis):
    n = n or 2 * world.size  # None: an even split
    shape = (n, 3) if axis == 0 else (3, n)
    x = _data(world.rank, shape, dtype)
    total = sum(_as64(_data(r, shape, dtype)) for r in range(world.size))
    expected = np.array_split(total, world.size, axis=axis)[world.rank]
    got = world.reduce_scatter(x, axis=axis)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(_as64(got), expected)


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_every_root(world, dtype):
    for root in range(world.size):
        x = _data(world.rank, (3, 5), dtype)
        world.broadcast(x, root=root)
        np.testing.assert_array_equal(_as64(x), _as64(_data(root, (3, 5), dtype)))


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("axis", [0, 1])
def test_gather_and_scatter_into_a_given_buffer(world, axis):
    x = _data(world.rank, (3, 4), np.float32)
    shape = (3 * world.size, 4) if axis == 0 else (3, 4 * world.size)
    out = np.full(shape, np.nan, np.float32)
    assert world.all_gather(x, axis=axis, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate(
        [_data(r, (3, 4), np.float32) for r in range(world.size)], axis=axis))
    big = _data(world.rank, shape, np.float32)
    block = np.full((3, 4), np.nan, np.float32)
    assert world.reduce_scatter(big, axis=axis, out=block) is block
    total = sum(_as64(_data(r, shape, np.float32)) for r in range(world.size))
    np.testing.assert_array_equal(block, np.array_split(total, world.size, axis=axis)[world.rank])
    with pytest.raises(HpcparError, match="the result needs"):
        world.all_gather(x, axis=axis, out=np.empty((1, 1), np.float32))


@pytest.mark.mpi(ranks=(2, 8))
def test_non_contiguous_input_gives_the_same_result(world):
    base = _data(world.rank, (6, 8), np.float32)
    view = base[:, ::2]  # non-contiguous (6, 4)
    expected = sum(_as64(_data(r, (6, 8), np.float32)[:, ::2]) for r in range(world.size))
    world.all_reduce(view)
    np.testing.assert_array_equal(_as64(view), expected)
    np.testing.assert_array_equal(base[:, 1::2], _data(world.rank, (6, 8), np.float32)[:, 1::2])
    gathered = world.all_gather(_data(world.rank, (6, 8), np.float32)[:, ::2], axis=1)
    assert gathered.shape == (6, 4 * world.size)


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_of_nonblocking_sends(world, dtype):
    nxt, prv = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    out = np.empty((4, 3), dtype=dtype)
    reqs = [world.irecv(out, source=prv, tag=7), world.isend(_data(world.rank, (4, 3), dtype),
                                                             dest=nxt, tag=7)]
    for r in reqs:
        r.wait()
    np.testing.assert_array_equal(_as64(out), _as64(_data(prv, (4, 3), dtype)))
    back = world.sendrecv(_data(world.rank, (2,), dtype, 1), dest=prv,
                          out=np.empty(2, dtype), source=nxt)
    np.testing.assert_array_equal(_as64(back), _as64(_data(nxt, (2,), dtype, 1)))


@pytest.mark.mpi(ranks=(2, 8))
def test_messages_of_unknown_length_are_probed_then_received(world):
    """Every other rank sends rank 0 a message whose length only it knows; rank 0 learns
    source and length from ``probe`` (none before anything is sent) and receives them all."""
    tag = 21
    if world.rank == 0:
        assert world.probe(tag, np.int64) is None
    world.barrier()
    if world.rank != 0:
        req = world.isend(np.arange(world.rank * 3, dtype=np.int64) + world.rank, 0, tag)
        req.wait()
        assert req.test()                        # complete stays complete
    else:
        got = {}
        for _ in range(world.size - 1):
            source, count = world.probe(tag, np.int64, wait=True)
            got[source] = world.recv(np.empty(count, np.int64), source, tag)
        assert sorted(got) == list(range(1, world.size))
        for r, a in got.items():
            np.testing.assert_array_equal(a, np.arange(r * 3) + r)
    world.barrier()


@pytest.mark.mpi(ranks=(2, 8))
def test_blocking_send_recv_between_pairs(world):
    pairs = world.size // 2 * 2
    if world.rank >= pairs:
        return
    x = _data(world.rank, (5,), np.float64)
    out = np.empty(5)
    if world.rank % 2 == 0:
        world.send(x, dest=world.rank + 1)
        world.recv(out, source=world.rank + 1)
        partner = world.rank + 1
    else:
        world.recv(out, source=world.rank - 1)
        world.send(x, dest=world.rank - 1)
        partner = world.rank - 1
    np.testing.assert_array_equal(out, _data(partner, (5,), np.float64))


@pytest.mark.mpi(ranks=(2, 8))
def test_every_operation_counts_its_bytes(world):
    world.stats.reset()
    x = np.ones((4, 8), dtype=np.float32)  # 128 bytes
    world.all_reduce(x)
    world.all_gather(x)
    world.reduce_scatter(np.ones((world.size * 2, 8), np.float32))
    world.broadcast(x)
    world.barrier()
    ops = world.stats.ops
    assert ops["world.all_reduce"].bytes == 128 and ops["world.all_reduce"].calls == 1
    assert ops["world.all_gather"].bytes == 128 * world.size
    assert ops["world.reduce_scatter"].bytes == world.size * 2 * 8 * 4
    assert ops["world.broadcast"].bytes == 128
    assert ops["world.barrier"].calls == 1
    assert world.stats.total_bytes == sum(s.bytes for s in ops.values())


@pytest.mark.mpi(ranks=(2, 8))
def test_wrong_gather_sizes_are_refused_before_communicating(world):
    from hpcpar.parallel.errors import HpcparError
    with pytest.raises(HpcparError, match="do not match"):
        world.all_gather(np.ones(3), sizes=[1] * world.size)


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1])
def test_gather_to_every_root_with_uneven_and_empty_blocks(world, dtype, axis):
    sizes = [r % 3 for r in range(world.size)]            # rank 0 gives nothing
    block = lambda r: _data(r, (sizes[r], 4) if axis == 0 else (4, sizes[r]), dtype)  # noqa: E731
    expected = np.concatenate([block(r) for r in range(world.size)], axis=axis)
    for root in range(world.size):
        got = world.gather(block(world.rank), root=root, axis=axis, sizes=sizes)
        if world.rank == root:
            assert got.dtype == np.dtype(dtype) and got.flags.c_contiguous
            np.testing.assert_array_equal(_as64(got), _as64(expected))
        else:
            assert got is None


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_gives_each_rank_its_block(world, dtype, axis):
    sizes = [r % 3 + 1 for r in range(world.size)]
    shape = (sum(sizes), 3) if axis == 0 else (3, sum(sizes))
    for root in range(world.size):
        full = _data(root, shape, dtype) if world.rank == root else None
        out = np.empty((sizes[world.rank], 3) if axis == 0 else (3, sizes[world.rank]), dtype)
        assert world.scatter(full, out, root=root, axis=axis) is out
        bounds = np.cumsum([0] + sizes)
        mine = np.take(_data(root, shape, dtype),
                       range(bounds[world.rank], bounds[world.rank + 1]), axis=axis)
        np.testing.assert_array_equal(_as64(out), _as64(mine))


@pytest.mark.mpi(ranks=(2, 8))
def test_a_scatter_that_does_not_fit_is_an_error_on_every_rank(world):
    from hpcpar.parallel.errors import HpcparError
    full = np.zeros((world.size + 1, 2), np.float32) if world.rank == 0 else None
    with pytest.raises(HpcparError, match="does not split into the blocks"):
        world.scatter(full, np.empty((1, 2), np.float32), root=0)


@pytest.mark.mpi(ranks=(2, 8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_sums_on_the_root_only(world, dtype):
    for root in range(world.size):
        x = _data(world.rank, (3, 5), dtype)
        before = x.copy()
        world.reduce(x, root=root)
        if world.rank == root:
            expected = sum(_as64(_data(r, (3, 5), dtype)) for r in range(world.size))
            np.testing.assert_array_equal(_as64(x), expected)
        else:
            np.testing.assert_array_equal(_as64(x), _as64(before))


@pytest.mark.mpi(ranks=(2, 8))
def test_max_reductions_and_the_non_blocking_sum(world):
    x = _data(world.rank, (4, 3), np.float32)
    expected_max = np.max([_data(r, (4, 3), np.float32) for r in range(world.size)], axis=0)
    np.testing.assert_array_equal(world.all_reduce(x.copy(), op="max"), expected_max)
    y = x.copy()
    world.reduce(y, root=0, op="max")
    if world.rank == 0:
        np.testing.assert_array_equal(y, expected_max)
    z = x.copy()
    request = world.iall_reduce(z)
    request.wait()
    np.testing.assert_array_equal(_as64(z), sum(_as64(_data(r, (4, 3), np.float32))
                                                for r in range(world.size)))
    with pytest.raises(HpcparError, match="op 'max' is not available for bfloat16"):
        world.all_reduce(_data(world.rank, (2,), bfloat16), op="max")


@pytest.mark.mpi(ranks=(2, 8))
def test_gather_scatter_and_reduce_count_their_bytes(world):
    world.stats.reset()
    block = np.ones((2, 4), np.float32)                    # 32 bytes
    world.gather(block, root=0)
    world.scatter(np.ones((2 * world.size, 4), np.float32) if world.rank == 0 else None,
                  np.empty((2, 4), np.float32), root=0)
    world.reduce(block, root=0)
    ops = world.stats.ops
    root = world.rank == 0
    assert ops["world.gather"].bytes == (32 * world.size if root else 32)
    assert ops["world.scatter"].bytes == (32 * world.size if root else 32)
    assert ops["world.reduce"].bytes == 32 and ops["world.reduce"].calls == 1
