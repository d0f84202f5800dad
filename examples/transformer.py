"""A user's own transformer trained with dp x pp x cp x tp from ``hpcpar.parallel`` alone,
equal to the same model trained by torch on one process.

    mpiexec -n 8 python examples/transformer.py                        # dp 2, pp 2, tp 2
    mpiexec -n 8 python examples/transformer.py --dp 1 --cp 2          # pp 2, cp 2, tp 2

The model (GPT-like, float64): a vocabulary-parallel token embedding plus a learned position
embedding; two blocks of pre-RMSNorm grouped-query attention (4 query heads sharing one KV
head; over tp 2 each rank holds two query heads and a replica of the KV head) and a gelu
MLP, with residuals; a final norm and a vocabulary-parallel LM head whose cross-entropy never
gathers the vocabulary. Attention is ring attention over the cp group (with cp 1 the ring has
one rank). Pipeline stage 0 holds the embeddings and block 0, stage 1 block 1 and the head,
under 1F1B with two micro-batches; with pp 1 one rank holds everything.

Each step: ``optimizer.zero_grad()``, ``pipe.train_step``, the KV head's partial gradients
summed over its replicas (``sum_partial_grads``), the gradients summed over dp x cp
(``GradientReducer.finish``), the norm over pp x tp clipped as torch clips, AdamW. The
losses and every rank's pieces of the trained weights equal torch's to 1e-10.
"""

import argparse
import importlib.util

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

VOCAB, D, HEADS, KV_HEADS, HD, FFN, LAYERS = 37, 16, 4, 1, 4, 32, 2
ROWS, T, MICRO, STEPS, LR, CLIP, EPS = 4, 15, 2, 3, 1e-2, 0.5, 1e-6
GELU, GELU_GRAD = hp.tensor.ACTIVATIONS["gelu_tanh"]


def make_weights(seed=0) -> dict:
    """The whole model's weights by name, the same on every rank."""
    rng = np.random.default_rng(seed)
    w = {"embed.tok.weight": rng.standard_normal((VOCAB, D)) * 0.5,
         "embed.pos": rng.standard_normal((T, D)) * 0.1,
         "head.norm.weight": 1 + 0.1 * rng.standard_normal(D),
         "head.lm.weight": rng.standard_normal((VOCAB, D)) * 0.3}
    for layer in range(LAYERS):
        for name, shape in [("attn.q.weight", (HEADS * HD, D)),
                            ("attn.k.weight", (KV_HEADS * HD, D)),
                            ("attn.v.weight", (KV_HEADS * HD, D)),
                            ("attn.o.weight", (D, HEADS * HD)),
                            ("mlp.up.weight", (FFN, D)), ("mlp.down.weight", (D, FFN))]:
            w[f"blocks.{layer}.{name}"] = rng.standard_normal(shape) / np.sqrt(shape[1])
        for name, n in [("mlp.up.bias", FFN), ("mlp.down.bias", D)]:
            w[f"blocks.{layer}.{name}"] = 0.1 * rng.standard_normal(n)
        for name in ("norm1.weight", "norm2.weight"):
            w[f"blocks.{layer}.{name}"] = 1 + 0.1 * rng.standard_normal(D)
    return w


# ---- the model, written per rank with the library's layers ----------------------------------

class RMSNorm:
    """y = x / rms(x) * w, with w replicated over tp (counted once in the norm)."""

    def __init__(self, tp, weight):
        self.weight = hp.Parameter(weight.copy(), decay=False, replicas=tp)

    def forward(self, x):
        r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS)
        return x * r * self.weight.data, (x * r, r)

    def backward(self, dy, ctx):
        xhat, r = ctx
        self.weight.grad += (dy * xhat).reshape(-1, D).sum(axis=0)
        dxhat = dy * self.weight.data
        return r * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))


class Attention:
    """Causal GQA: q, k, v column-parallel by whole heads, ring attention over cp, o
    row-parallel."""

    def __init__(self, tp, cp, w, prefix):
        def column(name):
            return hp.ColumnParallelLinear.from_full(tp, w[prefix + name], unit=HD)
        self.q, self.k, self.v = column("q.weight"), column("k.weight"), column("v.weight")
        self.o = hp.RowParallelLinear.from_full(tp, w[prefix + "o.weight"])
        self.ring = hp.RingAttention(hp.context_parallel.TiledAttention(np, block=8), cp)

    def forward(self, x, rows):
        B, n, _ = x.shape
        q = self.q.forward(x)[0].reshape(B, n, -1, HD)                      # (B, n, heads, hd)
        k, v = (p.forward(x)[0].reshape(B, n, -1, HD).transpose(0, 2, 1, 3)  # (B, kv, n, hd)
                for p in (self.k, self.v))
        out, ctx = self.ring.forward_train(q, k, v, rows)                   # (B, n, heads, hd)
        out = out.reshape(B, n, -1)
        y, _ = self.o.forward(out)
        return y, (x, out, ctx)

    def backward(self, dy, saved):
        x, out, ctx = saved
        B, n, _ = x.shape
        dout = self.o.backward(dy, out).reshape(B, n, -1, HD)
        dq, dk, dv = self.ring.backward(dout, ctx)                 # dk, dv: (B, kv, n, hd)
        dx = self.q.backward(dq.reshape(B, n, -1), x)              # each AllReduced over tp
        for proj, grad in ((self.k, dk), (self.v, dv)):
            dx += proj.backward(grad.transpose(0, 2, 1, 3).reshape(B, n, -1), x)
        return dx


class MLP:
    def __init__(self, tp, w, prefix):
        self.up = hp.ColumnParallelLinear.from_full(tp, w[prefix + "up.weight"],
                                                    w[prefix + "up.bias"])
        self.down = hp.RowParallelLinear.from_full(tp, w[prefix + "down.weight"],
                                                   w[prefix + "down.bias"])

    def forward(self, x):
        z, _ = self.up.forward(x)
        h = GELU(np, z)
        y, _ = self.down.forward(h)
        return y, (x, z, h)

    def backward(self, dy, ctx):
        x, z, h = ctx
        dz = self.down.backward(dy, h) * GELU_GRAD(np, z)
        return self.up.backward(dz, x)


class Block:
    def __init__(self, tp, cp, w, layer):
        p = f"blocks.{layer}."
        self.norm1 = RMSNorm(tp, w[p + "norm1.weight"])
        self.norm2 = RMSNorm(tp, w[p + "norm2.weight"])
        self.attn, self.mlp = Attention(tp, cp, w, p + "attn."), MLP(tp, w, p + "mlp.")

    def forward(self, x, rows):
        a, c1 = self.norm1.forward(x)
        b, c2 = self.attn.forward(a, rows)
        h = x + b
        m, c3 = self.norm2.forward(h)
        f, c4 = self.mlp.forward(m)
        return h + f, (c1, c2, c3, c4)

    def backward(self, dy, ctx):
        c1, c2, c3, c4 = ctx
        dh = dy + self.norm2.backward(self.mlp.backward(dy, c4), c3)
        return dh + self.norm1.backward(self.attn.backward(dh, c2), c1)


class Embedding:
    """Token rows split over tp by vocabulary; positions (this rank's, under cp) replicated."""

    def __init__(self, tp, w, positions):
        self.tok = hp.VocabParallelEmbedding.from_full(tp, w["embed.tok.weight"])
        self.pos = hp.Parameter(w["embed.pos"].copy(), replicas=tp)
        self.positions = positions

    def forward(self, ids):
        e, ctx = self.tok.forward(ids)                       # (B, n, D), AllReduced over tp
        return e + self.pos.data[self.positions], ctx

    def backward(self, dy, ctx):
        self.tok.backward(dy, ctx)
        self.pos.grad[self.positions] += dy.sum(axis=0)


class Head:
    def __init__(self, tp, w):
        self.norm = RMSNorm(tp, w["head.norm.weight"])
        self.lm = hp.ParallelLMHead.from_full(tp, w["head.lm.weight"])

    def forward(self, x):
        h, ctx = self.norm.forward(x)
        return self.lm.local_logits(h), (h, ctx)             # (B, n, vocab / tp)

    def backward(self, dlogits, saved):
        h, ctx = saved
        return self.norm.backward(self.lm.backward(dlogits, h), ctx)


class Stage:
    """One pipeline stage: the embedding (first), its blocks, the head (last)."""

    def __init__(self, mesh, w, first, last, layers):
        tp, cp = mesh.group("tp"), mesh.group("cp")
        self.shard = hp.ContextShard(T, cp.size, cp.rank)    # this rank's positions
        self.rows = None
        self.embed = Embedding(tp, w, self.shard.positions) if first else None
        self.blocks = {str(layer): Block(tp, cp, w, layer) for layer in layers}
        self.head = Head(tp, w) if last else None

    def forward(self, x):
        rows = self.shard.rows(np, [T] * len(x))
        ctxs = []
        if self.embed is not None:
            x, c = self.embed.forward(x)
            ctxs.append(c)
        for block in self.blocks.values():
            x, c = block.forward(x, rows)
            ctxs.append(c)
        if self.head is not None:
            x, c = self.head.forward(x)
            ctxs.append(c)
        return x, ctxs

    def backward(self, dy, ctxs):
        ctxs = list(ctxs)
        if self.head is not None:
            dy = self.head.backward(dy, ctxs.pop())
        for block in reversed(list(self.blocks.values())):
            dy = block.backward(dy, ctxs.pop())
        if self.embed is not None:
            self.embed.backward(dy, ctxs.pop())
        return dy


def train(args):
    mesh = hp.Mesh(MPI.COMM_WORLD,
                   {"dp": args.dp, "pp": args.pp, "cp": args.cp, "tp": args.tp})
    tp, pp = mesh.group("tp"), mesh.group("pp")
    w = make_weights()
    per_stage = hp.pipeline.stage_layers(LAYERS, pp.size, pp.rank)   # this stage's layer indices
    stage = Stage(mesh, w, pp.rank == 0, pp.rank == pp.size - 1, per_stage)
    ce = hp.VocabParallelCrossEntropy(None, VOCAB, tp)

    def loss(logits, target):                                 # on the last stage
        labels, weights = target
        shape = logits.shape
        value, ctx = ce.forward(logits.reshape(-1, shape[-1]), labels.reshape(-1),
                                weights.reshape(-1))
        return float(value), ce.backward(ctx).reshape(shape)

    pipe = hp.Pipeline(pp, stage, loss=loss, schedule="1f1b")
    params = pipe.named_parameters()
    reducer = hp.GradientReducer(mesh.group(("dp", "cp")), [list(params.values())])
    opt = hp.AdamW(params, lr=LR, weight_decay=0.1)
    norm_group = mesh.group(("pp", "tp"))
    data = np.random.default_rng(1).integers(0, VOCAB, (STEPS, ROWS, T + 1))
    dp, r = mesh.size("dp"), mesh.coord("dp")
    losses = []
    for ids in data:
        mine = ids[r * ROWS // dp:(r + 1) * ROWS // dp]              # this replica's rows
        inputs = stage.shard.take(mine[:, :-1])                      # this rank's positions
        labels = stage.shard.take(mine[:, 1:])
        weights = np.full(labels.shape, 1.0 / (ROWS * T))            # the global mean
        opt.zero_grad()
        step = pipe.train_step(hp.split_micro_batches(inputs, MICRO),
                               list(zip(hp.split_micro_batches(labels, MICRO),
                                        hp.split_micro_batches(weights, MICRO))))
        hp.data_parallel.sum_partial_grads(params.values())        # the KV head's replicas' parts
        reducer.finish()                             # summed over dp x cp
        norm = hp.grad_norm(list(params.values()), norm_group)
        opt.step(grad_scale=hp.clip_coefficient(norm, CLIP))
        total = np.array([sum(step)], dtype=np.float64)       # [] off the last stage
        losses.append(float(mesh.group(("dp", "cp", "pp")).all_reduce(total)[0]))
    return mesh, stage, params, losses


# ---- the same model and training in torch, on one process ----------------------------------

def train_torch():
    import torch
    w = {k: torch.tensor(v, requires_grad=True) for k, v in make_weights().items()}
    decay = [p for p in w.values() if p.ndim > 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in w.values() if p.ndim == 1],
                              "weight_decay": 0.0}], lr=LR)
    rms = lambda x, g: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * g  # noqa: E731
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    losses = []
    for ids in torch.tensor(np.random.default_rng(1).integers(0, VOCAB, (STEPS, ROWS, T + 1))):
        x = w["embed.tok.weight"][ids[:, :-1]] + w["embed.pos"]
        for layer in range(LAYERS):
            p = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"blocks.{layer}.")}
            a = rms(x, p["norm1.weight"])
            q = (a @ p["attn.q.weight"].T).view(ROWS, T, HEADS, HD).transpose(1, 2)
            k, v = ((a @ p[f"attn.{n}.weight"].T).view(ROWS, T, KV_HEADS, HD).transpose(1, 2)
                    .repeat_interleave(HEADS // KV_HEADS, dim=1) for n in "kv")
            s = (q @ k.transpose(-1, -2) / HD ** 0.5).masked_fill(~mask, float("-inf"))
            out = (s.softmax(-1) @ v).transpose(1, 2).reshape(ROWS, T, -1)
            x = x + out @ p["attn.o.weight"].T
            m = rms(x, p["norm2.weight"]) @ p["mlp.up.weight"].T + p["mlp.up.bias"]
            x = x + torch.nn.functional.gelu(m, approximate="tanh") @ p["mlp.down.weight"].T \
                + p["mlp.down.bias"]
        logits = rms(x, w["head.norm.weight"]) @ w["head.lm.weight"].T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().numpy() for k, v in w.items()}


def torch_reference(comm):
    """torch's losses and trained weights, computed on rank 0 and broadcast to every rank
    (buffer broadcasts): one torch import and run for the whole job."""
    if importlib.util.find_spec("torch") is None:         # on every rank: none waits alone
        raise SystemExit("examples/transformer.py checks itself against torch: "
                         "pip install torch (the CPU build is enough)")
    if comm.rank == 0:
        losses, weights = train_torch()
    else:
        losses, weights = [0.0] * STEPS, {k: np.empty_like(v) for k, v in make_weights().items()}
    losses = np.array(losses, dtype=np.float64)
    weights = {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in weights.items()}
    comm.Bcast(losses, root=0)
    for name in sorted(weights):
        comm.Bcast(weights[name], root=0)
    return losses.tolist(), weights


def my_piece(name: str, full: np.ndarray, stage: Stage, tp) -> np.ndarray:
    """This rank's piece of a whole weight, as the layers cut it."""
    if name.endswith(("tok.weight", "lm.weight")):
        layer = stage.embed.tok if "tok" in name else stage.head.lm
        rows = np.zeros((layer.weight.data.shape[0], D))
        rows[:layer.stop - layer.start] = full[layer.start:layer.stop]
        return rows
    unit = HD if ".attn." in name else 1
    if name.endswith(("q.weight", "k.weight", "v.weight", "up.weight", "up.bias")):
        a, b = hp.tensor.bounds(full.shape[0], tp.size, unit=unit)[tp.rank]
        return full[a:b]
    if name.endswith(("o.weight", "down.weight")):
        a, b = hp.tensor.bounds(full.shape[1], tp.size, unit=unit)[tp.rank]
        return full[:, a:b]
    return full                                  # norms, positions, row-parallel biases


def main():
    parser = argparse.ArgumentParser()
    for axis, default in (("dp", 2), ("pp", 2), ("cp", 1), ("tp", 2)):
        parser.add_argument(f"--{axis}", type=int, default=default)
    args = parser.parse_args()
    mesh, stage, params, losses = train(args)
    ref_losses, ref = torch_reference(MPI.COMM_WORLD)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert loss_error < 1e-10, (losses, ref_losses)
    weight_error = 0.0
    for name, p in params.items():
        logical = name.split(".", 1)[1]                  # without the stage's "stageN."
        want = my_piece(logical, ref[logical], stage, mesh.group("tp"))
        weight_error = max(weight_error, float(np.abs(p.data - want).max()
                                               / np.abs(ref[logical]).max()))
    assert weight_error < 1e-10, weight_error
    errors = MPI.COMM_WORLD.gather(weight_error)
    if MPI.COMM_WORLD.rank == 0:
        print(f"{mesh.describe()} of {mesh.shape}: losses "
              f"{' '.join(f'{v:.6f}' for v in losses)}; torch "
              f"{' '.join(f'{v:.6f}' for v in ref_losses)}")
        print(f"largest relative difference: losses {loss_error:.1e}, weights over ranks "
              f"{max(errors):.1e}: OK")
    mesh.free()


if __name__ == "__main__":
    main()
