"""Megatron's conjugate communication operators, each a forward and its backward.

Around a tensor-parallel block over a group of p ranks:

    f  CopyToGroup          forward: identity          backward: AllReduce
    g  ReduceFromGroup      forward: AllReduce         backward: identity
       ScatterToGroup       forward: keep own slice    backward: AllGather
       GatherFromGroup      forward: AllGather         backward: ReduceScatter
       ReduceScatterToGroup forward: ReduceScatter     backward: AllGather

f enters a column-parallel layer (every rank reads the whole input, so the input's gradient
is the sum of every rank's); g leaves a row-parallel one (the partial products are summed).
Megatron's sequence parallelism replaces g by ReduceScatter along the sequence and f by
AllGather, whose backward is a ReduceScatter: each rank's layer after the gather is its own
(a column block), so the gradient of the gathered input is the sum of every rank's.
Slices along ``axis`` follow ``numpy.array_split`` unless ``sizes`` are given.
"""

from __future__ import annotations

from typing import Sequence

from ..comm import Communicator, split_sizes


def _cut(x, group: Communicator, axis: int, sizes: Sequence[int] | None):
    sizes = list(sizes) if sizes is not None else split_sizes(x.shape[axis], group.size)
    start = sum(sizes[:group.rank])
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + sizes[group.rank])
    return x[tuple(index)], sizes


class CopyToGroup:
    """f: the identity forward; the backward sums the input gradient over the group."""

    @staticmethod
    def forward(x, group: Communicator):
        return x

    @staticmethod
    def backward(dy, group: Communicator):
        return group.all_reduce(dy)


class ReduceFromGroup:
    """g: the forward sums the partial results over the group; the backward is the identity."""

    @staticmethod
    def forward(x, group: Communicator):
        return group.all_reduce(x)

    @staticmethod
    def backward(dy, group: Communicator):
        return dy


class ScatterToGroup:
    """Keep this rank's slice along ``axis``; the backward gathers the slices' gradients."""

    @staticmethod
    def forward(x, group: Communicator, axis: int = -1, sizes=None):
        return _cut(x, group, axis, sizes)[0].copy()

    @staticmethod
    def backward(dy, group: Communicator, axis: int = -1, sizes=None):
        return group.all_gather(dy, axis=axis, sizes=sizes)


class GatherFromGroup:
    """AllGather along ``axis`` (every rank's slice, in rank order); the backward sums the
    gathered gradient over the group and keeps this rank's slice (ReduceScatter)."""

    @staticmethod
    def forward(x, group: Communicator, axis: int = 0, sizes=None):
        return group.all_gather(x, axis=axis, sizes=sizes)

    @staticmethod
    def backward(dy, group: Communicator, axis: int = 0, sizes=None):
        return group.reduce_scatter(dy, axis=axis, sizes=sizes)


class ReduceScatterToGroup:
    """Sum over the group and keep this rank's slice along ``axis``; the backward gathers:
    ``GatherFromGroup`` read the other way round."""

    forward = staticmethod(GatherFromGroup.backward)
    backward = staticmethod(GatherFromGroup.forward)


f = CopyToGroup
g = ReduceFromGroup
