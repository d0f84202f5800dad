"""Your own attention over a sequence split across ranks: context parallelism with ring
attention, forward and backward, checked against the dense computation on one rank.

    mpiexec -n 4 python examples/ring_attention.py

A 1,000-token sequence (two rows: one whole, one of 613 tokens and padding) goes through a
causal grouped-query self-attention with its own projections. Each rank of the cp group
holds two mirrored chunks of the positions (``ContextShard``), projects only those, and
``RingAttention`` passes the keys and values round the group. The outputs and the gradients
of q, k and v equal the whole sequence's, computed densely with NumPy on every rank.
"""

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

T, LENGTHS, HIDDEN, HEADS, KV_HEADS, D = 1000, [1000, 613], 64, 4, 2, 16


def dense_attention(q, k, v, lengths):
    """(B, T, heads, d) causal GQA softmax attention, each row over its own length."""
    B, T, nh, d = q.shape
    g = nh // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    seen = (s <= t)[None] & (s[None] < np.asarray(lengths)[:, None, None])        # (B, T, T)
    scores = np.where(seen[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def main():
    mesh = hp.Mesh(MPI.COMM_WORLD, {"cp": -1})
    cp = mesh.group("cp")
    rng = np.random.default_rng(0)                     # the same arrays on every rank
    x = rng.standard_normal((len(LENGTHS), T, HIDDEN))
    wq, wk, wv = (rng.standard_normal((HIDDEN, n * D)) / 8 for n in (HEADS, KV_HEADS, KV_HEADS))
    dout = rng.standard_normal((len(LENGTHS), T, HEADS, D))

    shard = hp.ContextShard(T, cp.size, cp.rank)       # this rank's positions
    mine = shard.take(x)                               # (B, local, hidden)
    B, n = mine.shape[:2]
    q = (mine @ wq).reshape(B, n, HEADS, D)
    k = (mine @ wk).reshape(B, n, KV_HEADS, D)
    v = (mine @ wv).reshape(B, n, KV_HEADS, D)
    ring = hp.RingAttention(hp.context_parallel.TiledAttention(np, block=64), cp)
    out, ctx = ring.forward_train(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                  shard.rows(np, LENGTHS))
    real = shard.positions[None, :] < np.asarray(LENGTHS)[:, None]        # not padding
    dq, dk, dv = ring.backward(shard.take(dout) * real[..., None, None], ctx)

    # the whole sequences on one rank, densely
    qf, kf, vf = ((x @ w).reshape(B, T, -1, D) for w in (wq, wk, wv))
    want = dense_attention(qf, kf, vf, LENGTHS)
    assert np.allclose(out[real], shard.take(want)[real], atol=1e-10), "output"
    # d<out, dout>/dk along a random direction: the ranks' pieces of dk summed, against
    # central differences of the dense attention (padding positions left out)
    direction = rng.standard_normal(kf.shape)
    whole = (np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None])[..., None, None]
    eps = 1e-6
    fd = float(((dense_attention(qf, kf + eps * direction, vf, LENGTHS)
                 - dense_attention(qf, kf - eps * direction, vf, LENGTHS)) * dout * whole
                ).sum() / (2 * eps))
    total = MPI.COMM_WORLD.allreduce(float((dk.transpose(0, 2, 1, 3)
                                            * shard.take(direction)).sum()))
    assert abs(total - fd) <= 1e-5 * max(1.0, abs(fd)), (total, fd)
    if cp.rank == 0:
        print(f"{T} positions over cp {cp.size}, {n} on rank 0 "
              f"({', '.join(f'{s.at}-{s.last}' for s in shard.segments())}): the dense "
              f"output, and d<out, dout>/dk along a random direction {total:.6f} = {fd:.6f}: OK")
    mesh.free()


if __name__ == "__main__":
    main()
