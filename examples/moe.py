"""A user's mixture-of-experts layer trained with expert parallelism (ep 2) x tp 2, equal to the
same layer computed densely in NumPy.

    mpiexec -n 4 python examples/moe.py
    mpiexec -n 2 python examples/moe.py

The layer routes each token to 2 of 8 experts (softmax top-k, weights renormalised, as
Mixtral), each expert a SwiGLU MLP. The two ep ranks hold 4 experts each and see different
tokens (they are data-parallel replicas for everything but the experts): a token whose
expert lives on the other rank goes there and back by all_to_all. Each expert is also split
over tp 2, as a Megatron MLP. The loss is a mean-squared error; the router's gradient is
summed over ep (data parallelism), the experts' are whole where they live. Three SGD steps
give the losses, the gradient norms and the weights of the dense computation on the whole
batch (every expert on every token, masked by the router's choice). The norm is
``hp.grad_norm`` over the ep x tp group: the experts' slices differ there, and the router,
replicated over ep and tp (its ``replicas``), counts once.
"""

import numpy as np
from mpi4py import MPI

import hpcpar.parallel as hp

E, TOP_K, HIDDEN, INTER, TOKENS, STEPS, LR = 8, 2, 12, 16, 24, 3, 0.05


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    weights = dict(router=rng.standard_normal((E, HIDDEN)),
                   gate=rng.standard_normal((E, INTER, HIDDEN)) * 0.3,
                   up=rng.standard_normal((E, INTER, HIDDEN)) * 0.3,
                   down=rng.standard_normal((E, HIDDEN, INTER)) * 0.3)
    batches = [(rng.standard_normal((TOKENS, HIDDEN)), rng.standard_normal((TOKENS, HIDDEN)))
               for _ in range(STEPS)]
    return weights, batches


def mse(y, target):
    """The rank's share of the mean over the whole batch, and its gradient."""
    scale = 1.0 / (TOKENS * HIDDEN)
    diff = y - target
    return float((diff * diff).sum() * scale), 2.0 * scale * diff


def silu(z):
    return z / (1 + np.exp(-z))


def dense_step(w, x, target):
    """Forward, backward and an SGD step of the whole layer on the whole batch, every expert
    on every token; the router's softmax in float32, as transformers (and hpcpar) run it."""
    logits = (x @ w["router"].T).astype(np.float32)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :TOP_K]
    top = np.take_along_axis(p, chosen, -1)
    total = top.sum(-1, keepdims=True)
    mix = np.zeros_like(p, dtype=np.float64)                      # (N, E) each expert's weight
    np.put_along_axis(mix, chosen, top / total, -1)
    g = np.einsum("nh,eih->nei", x, w["gate"])
    u = np.einsum("nh,eih->nei", x, w["up"])
    a = silu(g) * u
    out = np.einsum("nei,ehi->neh", a, w["down"])
    y = np.einsum("neh,ne->nh", out, mix)
    loss, dy = mse(y, target)
    grads = {}
    dmix = np.einsum("nh,neh->ne", dy, out)
    dout = mix[..., None] * dy[:, None, :]
    grads["down"] = np.einsum("neh,nei->ehi", dout, a)
    da = np.einsum("neh,ehi->nei", dout, w["down"])
    s = 1 / (1 + np.exp(-g))
    dg, du = da * u * s * (1 + g * (1 - s)), da * silu(g)
    grads["gate"], grads["up"] = (np.einsum("nei,nh->eih", d, x) for d in (dg, du))
    dtop = np.take_along_axis(dmix, chosen, -1)
    dtop = (dtop - (dtop * top / total).sum(-1, keepdims=True)) / total   # the renormalising
    dp = np.zeros_like(mix)
    np.put_along_axis(dp, chosen, dtop, -1)
    dlogits = p * (dp - (dp * p).sum(-1, keepdims=True))
    grads["router"] = dlogits.T @ x
    norm = np.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    return loss, norm, {k: v - LR * grads[k] for k, v in w.items()}


def main():
    comm = MPI.COMM_WORLD
    ep = 2
    mesh = hp.Mesh(comm, {"ep": ep, "tp": comm.Get_size() // ep})
    weights, batches = make_data()
    moe = hp.MoE.from_full(weights["router"], weights["gate"], weights["up"], weights["down"],
                           TOP_K, normalize=True, ep=mesh.group("ep"), tp=mesh.group("tp"))
    mine = slice(mesh.coord("ep") * TOKENS // ep, (mesh.coord("ep") + 1) * TOKENS // ep)
    losses, norms = [], []
    for x, target in batches:
        y, ctx = moe.forward(x[mine], train=True)
        loss, dy = mse(y, target[mine])
        for p in moe.parameters():
            p.grad[...] = 0
        moe.backward(dy, ctx)
        mesh.group("ep").all_reduce(moe.router.weight.grad)   # the replicas' sum (dp)
        norms.append(hp.grad_norm(moe.parameters(), mesh.group(("ep", "tp"))))
        for p in moe.parameters():
            p.data -= LR * p.grad
        losses.append(mesh.group("ep").all_reduce(np.array([loss]))[0])

    dense, want, want_norms = weights, [], []
    for x, target in batches:
        loss, norm, dense = dense_step(dense, x, target)
        want.append(loss)
        want_norms.append(norm)
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-6)
    tp, t = mesh.size("tp"), mesh.coord("tp")
    cut = slice(t * INTER // tp, (t + 1) * INTER // tp)
    np.testing.assert_allclose(moe.router.weight.data, dense["router"], rtol=1e-6, atol=1e-9)
    for name, p in moe.named_parameters().items():
        if name.startswith("experts."):
            _, e, role, _ = name.split(".")
            full = dense[role][int(e)]
            np.testing.assert_allclose(p.data, full[cut] if role != "down" else full[:, cut],
                                       rtol=1e-6, atol=1e-9, err_msg=name)
    if comm.Get_rank() == 0:
        print(f"losses {np.round(losses, 6).tolist()} and gradient norms "
              f"{np.round(norms, 6).tolist()}: the dense layer's; weights equal: OK")


if __name__ == "__main__":
    main()
