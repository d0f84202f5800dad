import pytest
from hypothesis import given, strategies as st

from hpcpar.jobs.layout import ParallelConfig
from hpcpar.jobs.layout import MeshCoords, coords_of, group_ranks, rank_of

dims = st.integers(1, 4)


@given(dims, dims, dims, st.data())
def test_coords_and_rank_are_inverse(dp, pp, tp, data):
    layout = ParallelConfig(dp=dp, pp=pp, tp=tp)
    rank = data.draw(st.integers(0, layout.world_size - 1))
    c = coords_of(rank, layout)
    assert rank_of(c, layout) == rank
    # the formula of docs/design.md §1, tp fastest
    assert rank == (c.dp_rank * pp + c.pp_rank) * tp + c.tp_rank


@given(dims, dims, dims, st.sampled_from(["dp", "pp", "tp"]))
def test_groups_partition_the_world(dp, pp, tp, axis):
    layout = ParallelConfig(dp=dp, pp=pp, tp=tp)
    groups = group_ranks(layout, axis)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(layout.world_size))
    size = getattr(layout, axis)
    assert all(len(g) == size for g in groups)
    for g in groups:  # members differ only along `axis`, in coordinate order
        coords = [coords_of(r, layout) for r in g]
        assert [getattr(c, f"{axis}_rank") for c in coords] == list(range(size))


def test_worked_example_8_ranks():
    layout = ParallelConfig(dp=2, pp=2, tp=2)
    assert group_ranks(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(layout, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(layout, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_worked_example_16_ranks():
    layout = ParallelConfig(dp=2, pp=2, tp=4)
    assert group_ranks(layout, "tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                         [12, 13, 14, 15]]
    assert group_ranks(layout, "pp")[:3] == [[0, 4], [1, 5], [2, 6]]
    assert group_ranks(layout, "dp")[:2] == [[0, 8], [1, 9]]
    assert coords_of(13, layout) == MeshCoords(dp_rank=1, pp_rank=1, tp_rank=1)


def test_out_of_range_rank_is_refused():
    with pytest.raises(ValueError):
        coords_of(8, ParallelConfig(dp=2, pp=2, tp=2))


@pytest.mark.mpi(ranks=(8,))               # layouts of every axis, three at once
def test_mesh_communicators_match_the_math(comm):
    from hpcpar.jobs.layout import job_mesh
    size = comm.Get_size()
    layouts = {ParallelConfig.infer(size, tp=tp, pp=pp)
               for tp in (1, 2, 4) for pp in (1, 2) if size % (tp * pp) == 0}
    for layout in sorted(layouts, key=lambda l: (l.dp, l.pp, l.tp)):
        mesh = job_mesh(comm, layout)
        mine = coords_of(comm.Get_rank(), layout)
        for axis in ("tp", "pp", "dp"):
            sub = mesh.group(axis).mpi_comm
            members = sub.allgather(comm.Get_rank())  # small Python ints: fine to pickle
            assert members in group_ranks(layout, axis)
            assert sub.Get_rank() == mesh.coord(axis) == getattr(mine, f"{axis}_rank")
        assert mesh.is_first("pp") == (mine.pp_rank == 0)
        assert mesh.is_last("pp") == (mine.pp_rank == layout.pp - 1)
        mesh.free()
