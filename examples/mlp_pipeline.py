"""A user's 2-layer MLP trained with tp 2 x pp 2 under 1F1B, equal to plain NumPy training.

    mpiexec -n 4 python examples/mlp_pipeline.py

The model is y = relu(x W1^T + b1) W2^T + b2 with a mean-squared-error loss. Pipeline stage 0
holds layer 1 as a column-parallel linear (each tp rank computes half of the hidden
features), stage 1 holds layer 2 as a row-parallel linear (each tp rank multiplies its half,
one AllReduce sums them). The hidden activation crosses the pipeline still split over tp:
tp rank i of stage 0 sends its half to tp rank i of stage 1. Four micro-batches per step run
under 1F1B; AdamW updates every rank's shards. The same training in plain NumPy on the whole
batch gives the same losses and weights (float64, to 1e-12).
"""

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

D_IN, HIDDEN, D_OUT, BATCH, MICRO_BATCHES, STEPS, LR = 6, 8, 3, 16, 4, 5, 1e-2


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    weights = dict(w1=rng.standard_normal((HIDDEN, D_IN)) * 0.5,
                   b1=rng.standard_normal(HIDDEN) * 0.1,
                   w2=rng.standard_normal((D_OUT, HIDDEN)) * 0.5,
                   b2=rng.standard_normal(D_OUT) * 0.1)
    batches = [(rng.standard_normal((BATCH, D_IN)), rng.standard_normal((BATCH, D_OUT)))
               for _ in range(STEPS)]
    return weights, batches


def mse(y, target):
    """The micro-batch's share of the mean over the whole batch, and its gradient."""
    scale = 1.0 / (BATCH * D_OUT)
    diff = y - target
    return float((diff * diff).sum() * scale), 2.0 * scale * diff


class ColumnStage:
    """Layer 1 on pipeline stage 0: h_i = relu(x W1_i^T + b1_i)."""

    def __init__(self, tp, w, b):
        self.linear = hp.ColumnParallelLinear.from_full(tp, w, b, name="w1")

    def forward(self, x):
        z, ctx = self.linear.forward(x)
        return np.maximum(z, 0), (ctx, z)

    def backward(self, dh, ctx):
        x, z = ctx
        return self.linear.backward(dh * (z > 0), x)         # dX: AllReduce over tp (f)

    def params(self):
        return self.linear.weights + self.linear.biases


class RowStage:
    """Layer 2 on pipeline stage 1: y = sum_i h_i W2_i^T + b2 (one AllReduce, g)."""

    def __init__(self, tp, w, b):
        self.linear = hp.RowParallelLinear.from_full(tp, w, b, name="w2")

    def forward(self, h):
        return self.linear.forward(h)

    def backward(self, dy, h):
        return self.linear.backward(dy, h)

    def params(self):
        return [self.linear.weight, self.linear.bias]


def train_distributed(weights, batches):
    mesh = hp.Mesh(MPI.COMM_WORLD, {"pp": 2, "tp": 2})
    tp = mesh.group("tp")
    stage = (ColumnStage(tp, weights["w1"], weights["b1"]) if mesh.coord("pp") == 0
             else RowStage(tp, weights["w2"], weights["b2"]))
    pipe = hp.Pipeline(mesh.group("pp"), stage, loss=mse, schedule="1f1b")
    opt = hp.AdamW(stage.params(), lr=LR, weight_decay=0.0)   # as the reference below
    losses = []
    for x, target in batches:
        for p in stage.params():
            p.zero_grad()
        step = pipe.train_step(hp.split_micro_batches(x, MICRO_BATCHES),
                               hp.split_micro_batches(target, MICRO_BATCHES))
        opt.step()
        losses.append(sum(step))
    # the trained weights, whole: gather the tp shards of each layer on its stage
    if mesh.coord("pp") == 0:
        w = tp.all_gather(stage.linear.weights[0].data, axis=0)
    else:
        w = tp.all_gather(stage.linear.weight.data, axis=1)
    return mesh, losses, w


def train_numpy(weights, batches):
    """The reference: the same model and AdamW (torch's rule) on the whole batch."""
    w = {k: v.copy() for k, v in weights.items()}
    state = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in w.items()}
    losses = []
    for t, (x, target) in enumerate(batches, start=1):
        z = x @ w["w1"].T + w["b1"]
        h = np.maximum(z, 0)
        y = h @ w["w2"].T + w["b2"]
        loss, dy = mse(y, target)
        dz = (dy @ w["w2"]) * (z > 0)
        grads = dict(w2=dy.T @ h, b2=dy.sum(0), w1=dz.T @ x, b1=dz.sum(0))
        for k, g in grads.items():
            m, v = state[k]
            m += (g - m) * 0.1
            v *= 0.999
            v += 0.001 * g * g
            denom = np.sqrt(v) / np.sqrt(1 - 0.999 ** t) + 1e-8
            w[k] -= LR / (1 - 0.9 ** t) * m / denom
        losses.append(loss)
    return losses, w


def main():
    weights, batches = make_data()
    mesh, losses, trained = train_distributed(weights, batches)
    ref_losses, ref = train_numpy(weights, batches)
    layer = "w1" if mesh.coord("pp") == 0 else "w2"
    weight_error = float(np.abs(trained - ref[layer]).max())
    if mesh.coord("pp") == 1:
        loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
        assert loss_error < 1e-12, (losses, ref_losses)
        if mesh.coord("tp") == 0:
            print("step losses:", " ".join(f"{v:.6f}" for v in losses))
            print(f"numpy      : {' '.join(f'{v:.6f}' for v in ref_losses)}")
            print(f"max |loss - numpy| {loss_error:.1e}")
    assert weight_error < 1e-12, weight_error
    errors = MPI.COMM_WORLD.gather(weight_error)
    if MPI.COMM_WORLD.rank == 0:
        print(f"max |weight - numpy| over ranks {max(errors):.1e}: OK")


if __name__ == "__main__":
    main()
