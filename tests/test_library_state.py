"""The library's optimizers and parameters on one process, against torch: an optimizer
resumed from its ``state_dict`` takes the same steps as one that never stopped (its step
count travels with the state), and a 16-bit layer learns in float32 (its master weights),
its compute copy refreshed by each step."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcpar.parallel as hp


def _steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad[...] = gp
        opt.step()


@pytest.mark.parametrize("make", [lambda p: hp.AdamW(p, lr=0.05),
                                  lambda p: hp.SGD(p, lr=0.1, momentum=0.9)])
def test_an_optimizer_resumed_from_its_state_dict_steps_as_one_that_never_stopped(make):
    rng = np.random.default_rng(0)
    start = [rng.standard_normal((3, 4)), rng.standard_normal(4)]
    grads = [[rng.standard_normal(w.shape) for w in start] for _ in range(4)]
    straight = {"w": hp.Parameter(start[0].copy()), "b": hp.Parameter(start[1].copy())}
    _steps(make(straight), list(straight.values()), grads)
    first = {"w": hp.Parameter(start[0].copy()), "b": hp.Parameter(start[1].copy())}
    opt = make(first)
    _steps(opt, list(first.values()), grads[:2])
    saved = {name: {k: np.array(v) for k, v in st.items()} for name, st in
             opt.state_dict().items()}
    resumed = {name: hp.Parameter(p.data.copy()) for name, p in first.items()}
    again = make(resumed)
    again.load_state_dict(saved)
    _steps(again, list(resumed.values()), grads[2:])
    for name in straight:
        np.testing.assert_allclose(resumed[name].data, straight[name].data, rtol=1e-13)


def test_a_bfloat16_layer_learns_in_float32_and_computes_with_the_refreshed_copy():
    from hpcpar.parallel.comm import create_communicator
    from hpcpar.parallel.device.dtypes import bfloat16
    tp = create_communicator(MPI.COMM_SELF, "mpi")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    layer = hp.ColumnParallelLinear.from_full(tp, w.astype(bfloat16))
    p = layer.weight
    assert p.data.dtype == bfloat16 and p.master.dtype == np.float32
    x = rng.standard_normal((16, 8)).astype(bfloat16)
    opt = hp.AdamW([p], lr=1e-4, weight_decay=0.0)
    ref = torch.tensor(w.astype(bfloat16).astype(np.float32), requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        opt.zero_grad()
        y, ctx = layer.forward(x)
        layer.backward(np.ones_like(y), ctx)
        opt.step()
        ref_opt.zero_grad()
        (torch.tensor(x.astype(np.float32)) @ ref.T).sum().backward()
        ref_opt.step()
    moved = np.abs(p.master - w.astype(bfloat16).astype(np.float32))
    assert moved.min() > 1e-3                  # every weight moved, as float32 moves it
    np.testing.assert_allclose(p.master, ref.detach().numpy(), rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(p.data, p.master.astype(bfloat16))      # refreshed


def _torch_groups(arrays, decays, optimizer, **opts):
    params = [torch.tensor(a) for a in arrays]
    groups = [{"params": [p for p, d in zip(params, decays) if d]},
              {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0}]
    if optimizer == "sgd":
        return params, torch.optim.SGD(groups, **opts)
    return params, torch.optim.AdamW(groups, **opts)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("backend", ["numpy", "strict"])
def test_one_pass_over_mixed_tensors_and_dtypes_is_torchs_update(optimizer, backend,
                                                                   monkeypatch):
    """Matrices (decayed) and vectors (not), in float32 and float64, updated over flat
    buffers in blocks that cut across tensors (the CPU's, made 7 elements long here) or in
    whole runs (a device's: the strict backend), with a gradient scale: torch's optimizer
    with the matrices in a decayed param group, step by step."""
    from hpcpar.parallel.optim import optimizers
    from hpcpar.parallel.device.strict_arrays import xp as strict_xp
    monkeypatch.setattr(optimizers, "BLOCK", 7)
    xp = strict_xp if backend == "strict" else np
    host = (lambda a: a.get()) if backend == "strict" else np.asarray
    rng = np.random.default_rng(3)
    shapes = [((3, 4), np.float32), ((4,), np.float32), ((5, 2), np.float32), ((3,), np.float32),
              ((2, 3), np.float64), ((3,), np.float64)]
    start = [rng.standard_normal(s).astype(t) for s, t in shapes]
    decays = [len(s) == 2 for s, _ in shapes]
    params = [hp.Parameter(xp.asarray(a), decay=d) for a, d in zip(start, decays)]
    opts = (dict(lr=0.1, momentum=0.9, weight_decay=0.1) if optimizer == "sgd"
            else dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    opt = (hp.SGD if optimizer == "sgd" else hp.AdamW)(params, **opts)
    ref, ref_opt = _torch_groups([a.copy() for a in start], decays, optimizer, **opts)
    for step in range(3):
        grads = [rng.standard_normal(a.shape).astype(a.dtype) for a in start]
        for p, r, g in zip(params, ref, grads):
            p.grad[...] = xp.asarray(g)
            r.grad = torch.tensor(g) * 0.5
        opt.step(grad_scale=0.5)
        ref_opt.step()
        for i, (p, r) in enumerate(zip(params, ref)):
            np.testing.assert_allclose(host(p.data), r.detach().numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"tensor {i}, step {step}")


def test_the_optimizer_takes_the_arrays_in_and_refuses_one_assigned_later():
    """Made, an optimizer moves a parameter's separate arrays into its flat buffers: the
    parameter's arrays are views of them, the arrays replaced are read-only (a write into
    one fails, rather than updating a copy nobody reads), and an array assigned to a
    parameter afterwards is refused at the next step."""
    w = np.ones((2, 3))
    p, q = hp.Parameter(w), hp.Parameter(np.zeros(4), decay=False)
    old_grad = p.grad
    opt = hp.SGD([p, q], lr=0.5)
    assert p.data is p.master and p.master.base is q.master.base is not None   # one buffer
    assert p.grad.base is q.grad.base is not None and not np.shares_memory(p.grad, old_grad)
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 2.0
    with pytest.raises(ValueError, match="read-only"):
        old_grad += 1.0
    p.grad[...] = 1.0
    opt.step()
    np.testing.assert_array_equal(p.data, 0.5)
    np.testing.assert_array_equal(w, 1.0)
    p.grad = np.ones((2, 3))
    with pytest.raises(hp.HpcparError, match="new array was assigned"):
        opt.step()
