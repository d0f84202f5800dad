"""A feed-forward block Y = act(X W1) W2 under three tensor-parallel policies.

X (rows, d), W1 (d, h), W2 (h, d), along one mesh axis of p ranks (``axis``):

    megatron    X replicated, W1 by columns (Shard(1)), W2 by rows (Shard(0)): H_i = act(X W1_i)
                is local, Y = sum_i H_i W2_i is one AllReduce. Backward: dH_i local, one
                AllReduce for dX (Megatron's f and g around the block).
    allgather   X replicated, W1 and W2 by columns: H_i local, AllGather H, Y_i = H W2_i,
                AllGather Y. Two AllGathers, no reduction; each rank keeps 1/p of both.
    sequence    X sharded by rows (the sequence), W1 by columns, W2 by rows: AllGather X,
                H_i local, ReduceScatter Y back to rows (Megatron's sequence parallelism:
                the AllReduce split into its two halves around the block).

Each is two ``matmul`` calls with the placements above, so its communication is the
redistribution those placements imply, forward and backward. ``activation`` is a name in
``ACTIVATIONS`` or a pair (f, df) of elementwise functions of the pre-activation.
"""

from __future__ import annotations

import math

from ..comm.agreement import trusted
from .darray import DArray
from ..device.dtypes import at_least_float32
from ..errors import HpcparError
from .placement import Replicate, Shard
from .sharded_matmul import matmul_backward, matmul_forward

FFN_POLICIES = ("megatron", "allgather", "sequence")


def _gelu_tanh(xp, z):
    return 0.5 * z * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def _gelu_tanh_grad(xp, z):
    c = math.sqrt(2.0 / math.pi)
    t = xp.tanh(c * (z + 0.044715 * z ** 3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * z * z)


def _silu(xp, z):
    return z / (1.0 + xp.exp(-z))


def _silu_grad(xp, z):
    s = 1.0 / (1.0 + xp.exp(-z))
    return s * (1.0 + z * (1.0 - s))


ACTIVATIONS = {
    "relu": (lambda xp, z: xp.maximum(z, 0), lambda xp, z: (z > 0).astype(z.dtype)),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_grad),
    "silu": (_silu, _silu_grad),
}

_PLACEMENTS = {          # (X, W1, W2, H, Y) along the policy's axis
    "megatron": (Replicate(), Shard(1), Shard(0), Shard(1), Replicate()),
    "allgather": (Replicate(), Shard(1), Shard(1), Replicate(), Replicate()),
    "sequence": (Shard(0), Shard(1), Shard(0), Shard(1), Shard(0)),
}


class FeedForward:
    """Y = act(X W1) W2 with W1, W2 given as DArrays placed for ``policy`` along ``axis``."""

    def __init__(self, w1: DArray, w2: DArray, policy: str = "megatron", axis: str | None = None,
                 activation="relu"):
        self.policy, self.w1, self.w2 = policy, w1, w2
        self.xp, self.axis = w1.mesh.backend.xp, axis
        try:
            self._validate(axis, activation)
            error = None
        except HpcparError as e:
            error = e
        self._agree("FeedForward", None, error, activation if isinstance(activation, str)
                    else "a pair (f, df)")

    def _validate(self, axis, activation) -> None:
        policy, w1, w2 = self.policy, self.w1, self.w2
        if policy not in FFN_POLICIES:
            raise HpcparError(f"feed-forward policy {policy!r} is not one of "
                              f"{', '.join(FFN_POLICIES)}")
        self.axis = axis if axis is not None else _only_axis(w1.mesh)
        fn = ACTIVATIONS.get(activation) if isinstance(activation, str) else activation
        if fn is None:
            raise HpcparError(f"activation {activation!r} is not one of "
                              f"{', '.join(ACTIVATIONS)} (or give a pair (f, df))")
        self.act, self.act_grad = fn
        x_pl, w1_pl, w2_pl, self.h_pl, self.y_pl = (
            {self.axis: p} for p in _PLACEMENTS[policy])
        self.x_pl = x_pl
        for name, w, want in (("W1", w1, w1_pl), ("W2", w2, w2_pl)):
            if w.placement_of(self.axis) != want[self.axis]:
                raise HpcparError(f"feed-forward policy {policy!r} takes {name} placed "
                                  f"{want[self.axis]!r} along {self.axis!r}, got "
                                  f"{w.placement_of(self.axis)!r}")

    def _agree(self, what: str, x: DArray | None, error=None, activation=None) -> None:
        """The ranks pass the same block (and input): one check per call."""
        mesh = self.w1.mesh
        if not mesh.checking:
            if error is not None:
                raise error
            return
        arrays = (("X", x), ("W1", self.w1), ("W2", self.w2)) if x is not None \
            else (("W1", self.w1), ("W2", self.w2))
        mesh.agree(what, [("policy", self.policy), ("axis", self.axis),
                          ("activation", activation)]
                   + [(f"{name}'s {label}", v) for name, a in arrays
                      for label, v in a.agreement_fields() + [("mesh", a.mesh.fingerprint)]],
                   error)

    def forward(self, x: DArray) -> tuple[DArray, tuple]:
        """(Y, ctx). X is redistributed to the policy's placement first if it is not there."""
        self._agree("FeedForward.forward", x)
        with trusted():
            return self._forward(x)

    def _forward(self, x: DArray) -> tuple[DArray, tuple]:
        x = x.redistribute(self.x_pl)
        # sequence: AllGather the rows here; its backward is the ReduceScatter of dX below
        z, ctx1 = matmul_forward(x.redistribute({self.axis: Replicate()}), self.w1,
                                 out=self.h_pl)
        h = z.like(self._activation(self.act, z.local))
        y, ctx2 = matmul_forward(h, self.w2, out=self.y_pl)
        return y, (z, ctx1, ctx2)

    def _activation(self, fn, z):
        """``fn`` of the pre-activation, in float32 for 16-bit ``z`` (as the models compute
        their activations), given back in ``z``'s dtype, which the next product takes."""
        return fn(self.xp, at_least_float32(self.xp, z)).astype(z.dtype, copy=False)

    def backward(self, dy: DArray, ctx) -> tuple[DArray, DArray, DArray]:
        """(dX, dW1, dW2), each placed like what it is the gradient of."""
        self._agree("FeedForward.backward", dy)
        with trusted():
            return self._backward(dy, ctx)

    def _backward(self, dy: DArray, ctx) -> tuple[DArray, DArray, DArray]:
        z, ctx1, ctx2 = ctx
        dh, dw2 = matmul_backward(dy, ctx2)
        dh = dh.redistribute(z.placements)
        dz = z.like(dh.local * self._activation(self.act_grad, z.local))
        dx, dw1 = matmul_backward(dz, ctx1, da_placements=self.x_pl)
        return dx, dw1, dw2


def _only_axis(mesh) -> str:
    if len(mesh.axis_names) != 1:
        raise HpcparError(f"a mesh of axes {list(mesh.axis_names)}: say which one the "
                          f"feed-forward block is split over (axis=)")
    return mesh.axis_names[0]
