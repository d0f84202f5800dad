"""Megatron's sequence parallelism with ``hpcpar.parallel``: a pre-norm MLP block whose norm and
residual run on each tp rank's own positions, trained with SGD, equal to the same block
computed densely in NumPy on one process.

    mpiexec -n 2 python examples/sequence_parallel.py
    mpiexec -n 4 python examples/sequence_parallel.py

The block is y = x + down(gelu(up(rmsnorm(x)))), x of shape (B, T, D). Over tp the sequence
is split: each rank holds T / tp positions of x, of the norm and of y. ``up`` is
column-parallel with ``sequence_axis=1`` (it AllGathers its input along the sequence; its
backward ReduceScatters dX), ``down`` row-parallel with ``sequence_axis=1`` (it
ReduceScatters its partial sums instead of AllReducing them). The norm's weight, replicated
over tp, reads only this rank's positions: its gradient is a partial sum
(``partial_grad=True``), made whole by ``hp.data_parallel.sum_partial_grads``. The loss is
a mean-squared error; three SGD steps give the dense computation's losses and weights.
"""

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

B, T, D, FFN, STEPS, LR, EPS = 2, 8, 12, 32, 3, 0.1, 1e-6
GELU, GELU_GRAD = hp.tensor.ACTIVATIONS["gelu_tanh"]


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    w = dict(norm=1 + 0.1 * rng.standard_normal(D), up=rng.standard_normal((FFN, D)) * 0.3,
             up_bias=0.1 * rng.standard_normal(FFN), down=rng.standard_normal((D, FFN)) * 0.3,
             down_bias=0.1 * rng.standard_normal(D))
    batches = [(rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D)))
               for _ in range(STEPS)]
    return w, batches


def rms_norm(x, w):
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS)
    return x * r * w, (x * r, r)


def rms_norm_backward(dy, ctx, w):
    """(dx, dw) of y = x r w."""
    xhat, r = ctx
    dxhat = dy * w
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).reshape(-1, D).sum(axis=0)


class Block:
    """This rank's block: the norm on its positions, the pair split over tp."""

    def __init__(self, tp, w):
        self.norm = hp.Parameter(w["norm"].copy(), decay=False, replicas=tp, partial_grad=True)
        self.up = hp.ColumnParallelLinear.from_full(tp, w["up"], w["up_bias"], sequence_axis=1)
        self.down = hp.RowParallelLinear.from_full(tp, w["down"], w["down_bias"],
                                                   sequence_axis=1)

    def forward(self, x):                                   # x: (B, T / tp, D)
        h, nctx = rms_norm(x, self.norm.data)
        z, _ = self.up.forward(h)                           # (B, T, FFN / tp): every position
        y, _ = self.down.forward(GELU(np, z))               # (B, T / tp, D): this rank's
        return x + y, (h, nctx, z)

    def backward(self, dy, ctx):
        h, nctx, z = ctx
        dz = self.down.backward(dy, GELU(np, z)) * GELU_GRAD(np, z)
        dh = self.up.backward(dz, h)                        # (B, T / tp, D)
        dx, dw = rms_norm_backward(dh, nctx, self.norm.data)
        self.norm.grad += dw                                # this rank's positions' part
        return dy + dx


def dense_steps(w, batches):
    """The same training on one process: the losses and the final weights."""
    w = {k: v.copy() for k, v in w.items()}
    losses = []
    for x, target in batches:
        h, nctx = rms_norm(x, w["norm"])
        z = h @ w["up"].T + w["up_bias"]
        a = GELU(np, z)
        y = x + a @ w["down"].T + w["down_bias"]
        losses.append(((y - target) ** 2).mean())
        dy = 2 * (y - target) / y.size
        dz = (dy @ w["down"]) * GELU_GRAD(np, z)
        _, dnorm = rms_norm_backward(dz @ w["up"], nctx, w["norm"])
        grads = dict(norm=dnorm, up=np.einsum("bti,btd->id", dz, h), up_bias=dz.sum((0, 1)),
                     down=np.einsum("btd,bti->di", dy, a), down_bias=dy.sum((0, 1)))
        for k in w:
            w[k] -= LR * grads[k]
    return losses, w


def main():
    mesh = hp.Mesh(MPI.COMM_WORLD, {"tp": MPI.COMM_WORLD.Get_size()})
    tp = mesh.group("tp")
    w, batches = make_data()
    block = Block(tp, w)
    params = [block.norm] + block.up.parameters() + block.down.parameters()
    optimizer = hp.SGD(params, lr=LR)
    mine = slice(tp.rank * T // tp.size, (tp.rank + 1) * T // tp.size)    # this rank's positions
    losses = []
    for x, target in batches:
        optimizer.zero_grad()
        y, ctx = block.forward(x[:, mine])
        err = y - target[:, mine]
        losses.append(tp.all_reduce(np.array([(err ** 2).sum()]))[0] / (B * T * D))
        block.backward(2 * err / (B * T * D), ctx)
        hp.data_parallel.sum_partial_grads(params)        # the norm's parts, summed over tp
        optimizer.step()
    ref_losses, ref = dense_steps(w, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    np.testing.assert_allclose(block.norm.data, ref["norm"], rtol=1e-12)
    np.testing.assert_allclose(block.down.weight.data, ref["down"][:, block_cut(tp)],
                               rtol=1e-12)
    np.testing.assert_allclose(block.up.weight.data, ref["up"][block_cut(tp)], rtol=1e-12)
    np.testing.assert_allclose(block.down.bias.data, ref["down_bias"], rtol=1e-12)
    if tp.rank == 0:
        print(f"losses {' '.join(f'{v:.6f}' for v in losses)}: the dense block's; OK")


def block_cut(tp):
    """This rank's features of the hidden layer (``from_full``'s even split)."""
    return slice(tp.rank * FFN // tp.size, (tp.rank + 1) * FFN // tp.size)


if __name__ == "__main__":
    main()
